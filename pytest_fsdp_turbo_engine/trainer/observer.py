"""The harness's external module for verl's trainer: verl imports it (VERL_USE_EXTERNAL_MODULES) in
every process of a run, and it measures from outside verl. Nothing in verl is edited and nothing
is read from the engine's own objects (its optimizer, its state-dict copy); the hooks are torch's
(fully_shard, module forward pre-hooks, FSDP2's root post-backward callback, torch.distributed's
collectives, the global optimizer step hooks) and verl's public seams (EngineRegistry.new, the
vLLM worker extension's weight update, the tracking logger).

The engine instance verl's registry builds also gets two wrappers (whatever its class): around
`train_batch` (the mini-batch the actor hands it) and around `optimizer_step` (the raw gradients'
sums of squares as it begins, the micro-batch pair where the case declares it, the norm it
returns).

What each process writes, under the run folder's observe/ (trainer_files.py names them, the
records are trainer_records.py's):
- a trainer rank: per optimizer step, reduce-scatters and every collective that carried parameter
  gradients (fsdp_probe.CollectiveCounter, from the first training forward to the start of
  optimizer_step) per training micro-batch, unsharded gradient bytes held between micro-batches, the FSDP units that ran, the shard group, its raw gradient
  shard's sum of squares, the norm its engine reported; after the step (rank 0) a digest of every
  parameter, gathered whole, in each dtype a rollout may be served in;
- a rollout replica (a vLLM worker): per weight push, the digest of every tensor it received;
- the trainer (TaskRunner): verl's own step metrics.
Each file is rewritten whole after each event, so what was measured survives a failure later.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import (
    RECEIVED,
    ObservedRank,
    ObservedReplica,
    ObservedStep,
    Push,
    write_json,
    write_record,
)
from pytest_fsdp_turbo_contract.trainer_spec import RUN_DIR_VARIABLE, TrainerSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind
from pytest_fsdp_turbo_engine.trainer.imports import after_import

DIGEST_DTYPES = ("float32", "bfloat16", "float16")  # what a rollout may serve the weights in


def digest(tensor) -> str:
    """The exact bytes of a tensor, hashed (its dtype is part of what the caller names)."""
    import torch

    data = tensor.detach().contiguous().cpu().flatten().view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


class TrainerRank:
    """One trainer rank's readings, per optimizer step."""

    def __init__(
        self, folder: TrainerFolder, rank: int, capture: bool = False, pairs: bool = False
    ) -> None:
        self.folder, self.rank = folder, rank
        self.capture = capture  # what the reference replays (capture.py), every step
        self.pairs = pairs  # the micro-batch pair (micro_batch_pair.py), every step
        self._pairing = False  # the pair's own pass is running: none of it is the engine's step
        self._mini_batch: tuple[Any, Any] | None = None  # train_batch's data and loss function
        self._pair: dict[str, list[float]] | None = None
        self._pair_s: float | None = None
        self._loss_grads: dict[str, Any] = {}  # row digest -> d loss / d its response log-probs
        self.roots: list = []  # modules fully_shard was applied to, in order
        self.steps: list[ObservedStep] = []
        self.post_step: dict[str, dict[str, str]] = {}
        self._pass: dict[str, Any] | None = None  # the training pass since the last step
        self._micro_batch_open = False
        self._units: Any = None  # fsdp_probe.UnitsThatRan over the trained model's units
        self._collectives: Any = None  # fsdp_probe.CollectiveCounter over the training pass
        self._batch: dict[str, Any] = {}  # what train_batch was handed, until the step
        self.batches = 0  # mini-batches train_batch was handed
        self.engine_class = ""  # the class of the engine train_batch ran on
        # each local gradient shard's sum of squares as the engine's optimizer_step began (the raw
        # gradients, before its clip), until the step
        self._raw_sq: list[float] = []
        self._inner: set[int] | None = None  # ids of the units inside another unit
        self._capture_s = 0.0  # the reference's capture, since the last step (seconds)
        self._steps_at_clip = 0  # steps taken when optimizer_step began

    # -- the trained model ---------------------------------------------------------------------
    def sharded(self, module) -> None:
        self.roots.append(module)
        self._inner = None  # recomputed on the next forward
        module.register_forward_pre_hook(self._forward)

    def _is_root(self, module) -> bool:
        """Not inside another module fully_shard was applied to (found once per new unit, so a
        unit's forward costs a set lookup)."""
        if self._inner is None:
            units = {id(unit) for unit in self.roots}
            self._inner = {
                id(inner)
                for unit in self.roots
                for inner in unit.modules()
                if inner is not unit and id(inner) in units
            }
        return id(module) not in self._inner

    def _forward(self, module, args) -> None:
        import torch

        if self._pairing or not (
            torch.is_grad_enabled() and module.training and self._is_root(module)
        ):
            return  # forward-only passes (old and reference log-probs), inner units, the pair
        from pytest_fsdp_turbo_engine.step import fsdp_probe

        if self._pass is None:
            self._units = fsdp_probe.UnitsThatRan(module).__enter__()
            self._collectives = fsdp_probe.CollectiveCounter().__enter__()
            self._collectives.watch(module)
            self._pass = {
                "module": module,
                "retained_grad_bytes": [],
                "shard_group_size": fsdp_probe.shard_group_size(module),
            }
        else:  # what the previous micro-batches' backwards left unsharded
            self._pass["retained_grad_bytes"].append(fsdp_probe.unsharded_grad_bytes(module))
        # a micro-batch's backward, and what the engine does after it, land on its forward's entry
        self._collectives.next_micro_batch()

    def _collectives_done(self) -> None:
        """The training pass's collectives are all in as optimizer_step begins (the reference's
        gathers and the clip's norm come after): the counter's wrappers come off."""
        if self._collectives is not None and self._pass is not None:
            self._collectives.__exit__(None, None, None)
            self._pass["reduce_scatters"] = self._collectives.reduce_scatters
            self._pass["gradient_collectives"] = self._collectives.gradient_collectives
        self._collectives = None

    def backward_done(self, modules) -> None:
        """FSDP2's root post-backward callback ran: the raw gradient shard's sum of squares (the
        last micro-batch's is what the step clips)."""
        # the callback is queued by whichever unit's state saw backward first, not the root's
        if self._pairing or self._pass is None:
            return
        if not any(_contains(self._pass["module"], m) for m in modules):
            return
        self._pass["shard_grad_sq"] = sum(_squares(self._pass["module"]))

    def before_clip(self) -> None:
        """The engine's optimizer_step began: its raw gradients, one sum of squares a shard (and,
        for the reference, every gradient gathered whole: a collective, every rank calls it)."""
        self._steps_at_clip = len(self.steps)
        self._collectives_done()
        if self._pass is not None:
            self._raw_sq = _squares(self._pass["module"])
            if self.capture:
                with self._timed():
                    self._gather_whole("grads.pt", self._pass["module"], gradients=True)

    def mini_batch(self, data, loss_function) -> None:
        """What train_batch was handed, for the pair (the loss function as verl made it)."""
        self._mini_batch = (data, loss_function) if self.pairs else None

    def pair(self, engine) -> None:
        """The micro-batch pair, as the engine's optimizer_step begins (its k micro-batches'
        gradients are all in): one more pass of the same mini-batch, the engine's gradients put
        back after. Only with more than one micro-batch: one is its own pair."""
        mini_batch, self._mini_batch = self._mini_batch, None
        if self._pass is None or mini_batch is None:
            return
        if len(self._pass.get("reduce_scatters", [])) < 2:
            return
        from pytest_fsdp_turbo_engine.trainer.micro_batch_pair import (
            one_pass_against_accumulated,
        )

        module = self._pass["module"]
        started = time.perf_counter()
        self._pairing = True
        try:
            pair = one_pass_against_accumulated(
                engine, module, [u for u in self.roots if self._is_root(u)], *mini_batch
            )
        finally:
            self._pairing = False
            self._pair_s = time.perf_counter() - started
        # the engine steps on exactly what it accumulated, or the pair is no reading (h is red):
        # an engine whose backward adds into gradient buffers of its own would add the pair's
        if _squares(module) != self._raw_sq:
            print(
                "pytest-fsdp-turbo: the micro-batch pair's pass changed the gradients the engine "
                "holds (its backward adds into buffers of its own?): no pair reading this step",
                file=sys.stderr,
                flush=True,
            )
            return
        self._pair = pair or None  # nothing compared is no reading

    def watch_loss(self, loss_function):
        """verl's loss, as the actor hands it to the engine: the gradient that reaches each row's
        response log-probs in the backward (what check l holds to the loss in closed form)."""
        from pytest_fsdp_turbo_engine.trainer import capture

        def loss(*args, **kwargs):
            output = kwargs.get("model_output", args[1] if len(args) > 1 else None)
            data = kwargs.get("data", args[2] if len(args) > 2 else None)
            logprobs = None if output is None else output.get("log_probs", None)
            if logprobs is not None and logprobs.requires_grad and data is not None:
                keys = [digest(row) for row in capture.rows_of(data["input_ids"])]
                where = capture.response_slices(data)

                values = _flat(logprobs)

                def seen(grad) -> None:
                    started = time.perf_counter()
                    flat = _flat(grad)
                    for key, (start, end) in zip(keys, where):
                        self._loss_grads[key] = {
                            "logprobs": values[start:end].detach().float().cpu(),
                            "grad": flat[start:end].detach().float().cpu(),
                        }
                    self._capture_s += time.perf_counter() - started

                logprobs.register_hook(seen)
            return loss_function(*args, **kwargs)

        return loss

    @contextlib.contextmanager
    def _timed(self):
        """What the capture costs the step, taken by the harness on its own work."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._capture_s += time.perf_counter() - started

    def _captured(self, name: str, step: int | None = None) -> Path:
        """Under the step in progress (the steps counted so far), or `step`."""
        return self.folder.capture(len(self.steps) if step is None else step) / name

    def _gather_whole(self, name: str, module, gradients: bool, step: int | None = None) -> None:
        """Every parameter (or gradient) gathered whole, one at a time; rank 0 keeps them."""
        from pytest_fsdp_turbo_engine.engines.fsdp2 import full_tensor
        from pytest_fsdp_turbo_engine.step import fsdp_probe
        from pytest_fsdp_turbo_engine.trainer import capture

        whole = {}
        for key, param in module.named_parameters():
            value = param.grad if gradients else param
            if value is None:
                continue
            tensor = full_tensor(value.detach())
            if self.rank == 0:
                whole[fsdp_probe._plain_name(key)] = tensor.float().cpu()
            del tensor
        if self.rank == 0:
            capture.save(self._captured(name, step), whole)

    def batch_seen(self, data) -> None:
        """train_batch's mini-batch, as the actor hands it: each row's tokens digested (rows
        disjoint across data-parallel ranks), and the advantages' largest magnitude."""
        rows = _rows(data.get("input_ids", None))
        advantages = data.get("advantages", None)
        self.batches += 1
        self._batch.setdefault("rows", []).extend(digest(row) for row in rows)
        if self.capture:
            from pytest_fsdp_turbo_engine.trainer import capture

            with self._timed():
                batch = capture.mini_batch(data)
                capture.save(self._captured(f"batch-rank{self.rank}.pt"), batch)
        if advantages is not None:
            values = advantages.values() if getattr(advantages, "is_nested", False) else advantages
            peak = float(values.detach().abs().max()) if values.numel() else 0.0
            self._batch["advantages_abs_max"] = max(
                self._batch.get("advantages_abs_max", 0.0), peak
            )
        self._write()  # a step that never comes still leaves the batch it was handed

    def _stepped_against_raw(self) -> dict[str, float]:
        """The clip, read from outside: the scale from the raw gradients' norm to the stepped
        ones', and how far any one shard's own scale strays from it (a clip by the shard's own
        norm, a shard zeroed or changed). Sums of squares only: no gradient is copied."""
        stepped = _squares(self._pass["module"]) if self._pass else []
        if not self._raw_sq or len(stepped) != len(self._raw_sq):
            return {}
        raw, total = sum(self._raw_sq), sum(stepped)
        if raw == 0:  # no gradient reached this rank: any scale fits; the step's must be 0
            return {"stepped_residual": math.sqrt(total)}
        scale = math.sqrt(total / raw)
        own = [
            math.sqrt(s / r) if r else (math.inf if s else scale)
            for r, s in zip(self._raw_sq, stepped)
        ]
        stray = max(abs(x - scale) for x in own)
        return {"stepped_scale": scale, "stepped_residual": stray / scale if scale else stray}

    def before_step(self, optimizer) -> None:
        self._collectives_done()  # an engine whose optimizer_step verl's registry did not wrap
        if self._pass is None:
            return
        if self.capture:
            from pytest_fsdp_turbo_engine.trainer import capture

            with self._timed():
                self._gather_whole("params-before.pt", self._pass["module"], gradients=False)
                loss_grads, self._loss_grads = self._loss_grads, {}
                capture.save(self._captured(f"loss-grad-rank{self.rank}.pt"), loss_grads)
        fit = self._stepped_against_raw()
        done = ObservedStep(
            reduce_scatters_by_micro_batch=self._pass.get("reduce_scatters", []),
            gradient_collectives_by_micro_batch=self._pass.get("gradient_collectives", []),
            retained_grad_bytes=self._pass["retained_grad_bytes"],
            shard_group_size=self._pass["shard_group_size"],
            shard_grad_sq=self._pass.get("shard_grad_sq"),
            fsdp_units=self._units.count if self._units is not None else None,
            rows=self._batch.get("rows", []),
            advantages_abs_max=self._batch.get("advantages_abs_max"),
            stepped_scale=fit.get("stepped_scale"),
            stepped_residual=fit.get("stepped_residual"),
            capture_seconds=self._capture_s if self.capture else None,
            micro_batch_pair=self._pair,
            pair_seconds=self._pair_s,
        )
        self._batch, self._raw_sq, self._capture_s = {}, [], 0.0
        self._pair, self._pair_s = None, None
        if self._units is not None:
            self._units.__exit__(None, None, None)
        self.steps.append(done)
        self._write()

    def after_step(self, optimizer) -> None:
        if self._pass is None:
            return
        module, self._pass, self._units = self._pass["module"], None, None
        if self.capture:  # the step is counted already (before_step)
            with self._timed():
                self._gather_whole("params-after.pt", module, False, step=len(self.steps) - 1)
            self.steps[-1].capture_seconds = (
                self.steps[-1].capture_seconds or 0.0
            ) + self._capture_s
        self._capture_s = 0.0
        self._digest_parameters(module)
        self._write()

    def reported(self, norm) -> None:
        """The norm optimizer_step returned, on the step it took (none where it skipped the
        optimizer's step, as verl does for a norm that is not finite: the run then fails)."""
        value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if len(self.steps) > self._steps_at_clip:
            self.steps[-1].reported_grad_norm = value
        elif self._pass is not None:  # no step: the next mini-batch's forward starts a new pass
            if self._units is not None:
                self._units.__exit__(None, None, None)
            self._pass, self._units = None, None
        self._write()

    def _digest_parameters(self, module) -> None:
        """Every parameter gathered whole, one at a time (a collective: every rank calls it)."""
        import torch

        from pytest_fsdp_turbo_engine.engines.fsdp2 import full_tensor
        from pytest_fsdp_turbo_engine.step import fsdp_probe

        digests = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            whole = full_tensor(param.detach())
            if self.rank == 0:
                digests[fsdp_probe._plain_name(name)] = {
                    dtype: digest(whole.to(getattr(torch, dtype))) for dtype in DIGEST_DTYPES
                }
            del whole
        self.post_step = digests

    def _write(self) -> None:
        observed = ObservedRank(
            self.rank, os.getpid(), self.steps, self.post_step, self.batches, self.engine_class
        )
        write_record(self.folder.rank(self.rank), observed)


def _squares(module) -> list[float]:
    """Each local gradient shard's sum of squares, in float32 on its device, read once each."""
    return [float(g.detach().float().pow(2).sum()) for g in _local_grads(module)]


def _local_grads(module) -> list:
    """The module's gradients, each its rank's own shard."""
    grads = (p.grad for p in module.parameters() if p.grad is not None)
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def _rows(ids) -> list:
    """Each row's tokens (a nested batch's rows, or a padded batch's)."""
    if ids is None:
        return []
    return list(ids.unbind()) if getattr(ids, "is_nested", False) else list(ids)


def _flat(tensor):
    """A micro-batch's per-token output as one flat tensor (a nested tensor's values)."""
    return (tensor.values() if getattr(tensor, "is_nested", False) else tensor).flatten()


def _contains(outer, inner) -> bool:
    return any(m is inner for m in outer.modules())


class Replica:
    """One rollout replica (a vLLM worker): what each weight push handed it."""

    def __init__(self, folder: TrainerFolder) -> None:
        self.folder = folder
        self.pushes: list[Push] = []

    def push_started(self) -> None:
        self.pushes.append({})

    def received(self, weights) -> None:
        if not self.pushes:
            self.pushes.append({})
        import torch

        for name, tensor in weights:  # as received, and in each dtype a rollout may serve it in
            digests = {dtype: digest(tensor.to(getattr(torch, dtype))) for dtype in DIGEST_DTYPES}
            self.pushes[-1][name] = {RECEIVED: str(tensor.dtype).removeprefix("torch."), **digests}
        write_record(self.folder.replica(os.getpid()), ObservedReplica(os.getpid(), self.pushes))


def _observe_trainer_rank(folder: TrainerFolder) -> None:
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from pytest_fsdp_turbo_engine.step.fsdp_probe import FSDPInternalsChanged

    spec = TrainerSpec.read(folder.spec)
    rank = TrainerRank(
        folder, int(os.environ["RANK"]), capture=spec.reference, pairs=spec.micro_batch_pair
    )

    def shard_wrapped(original):
        def fully_shard(module, *args, **kwargs):
            out = original(module, *args, **kwargs)
            for each in module if isinstance(module, list) else [module]:
                rank.sharded(each)
            return out

        return fully_shard

    import torch.distributed.fsdp as fsdp

    wrapped = shard_wrapped(fsdp.fully_shard)
    fsdp.fully_shard = wrapped
    try:
        import torch.distributed._composable.fsdp as composable

        composable.fully_shard = wrapped
    except ImportError:
        pass

    def verl_fsdp_utils(module) -> None:  # imported it before this module ran
        if getattr(module, "fully_shard", None) not in (None, wrapped):
            module.fully_shard = wrapped

    after_import("verl.utils.fsdp_utils", verl_fsdp_utils)

    from torch.distributed.fsdp._fully_shard import _fsdp_state

    final = getattr(_fsdp_state.FSDPState, "_root_post_backward_final_callback", None)
    if final is None:
        raise FSDPInternalsChanged(
            f"torch {torch.__version__}: FSDPState has no _root_post_backward_final_callback; "
            "update pytest_fsdp_turbo_engine.trainer.observer"
        )

    def root_post_backward_final_callback(state) -> None:
        final(state)
        rank.backward_done(getattr(state, "_modules", ()))

    state_class: Any = _fsdp_state.FSDPState
    state_class._root_post_backward_final_callback = root_post_backward_final_callback
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: rank.before_step(optimizer))
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: rank.after_step(optimizer))

    def engine_registry(base) -> None:
        """What each engine reports from optimizer_step, from outside it: the instance verl's
        registry builds gets a wrapper around whatever optimizer_step its class has."""
        registry = base.EngineRegistry
        new = registry.new.__func__

        def built(cls, *args, **kwargs):
            engine = new(cls, *args, **kwargs)
            step = engine.optimizer_step

            def optimizer_step(*a, **k):
                rank.before_clip()
                rank.pair(engine)
                norm = step(*a, **k)
                rank.reported(norm)
                return norm

            engine.optimizer_step = optimizer_step
            train = engine.train_batch

            def train_batch(data, *a, **k):
                rank.engine_class = f"{type(engine).__module__}.{type(engine).__name__}"
                rank.batch_seen(data)
                rank.mini_batch(data, k.get("loss_function", a[0] if a else None))
                if rank.capture and "loss_function" in k:
                    k["loss_function"] = rank.watch_loss(k["loss_function"])
                elif rank.capture and a:
                    a = (rank.watch_loss(a[0]), *a[1:])
                return train(data, *a, **k)

            engine.train_batch = train_batch
            return engine

        registry.new = classmethod(built)

    after_import("verl.workers.engine.base", engine_registry)


def _observe_replica(folder: TrainerFolder) -> None:
    replica = Replica(folder)

    def extension(module) -> None:
        cls = module.vLLMColocateWorkerExtension
        update, push = cls._update_weights, cls.update_weights_from_ipc

        def update_weights_from_ipc(self, *args, **kwargs):
            replica.push_started()
            return push(self, *args, **kwargs)

        def _update_weights(self, weights, *args, **kwargs):
            weights = list(weights)
            replica.received(weights)
            return update(self, weights, *args, **kwargs)

        cls.update_weights_from_ipc = update_weights_from_ipc
        cls._update_weights = _update_weights

    after_import("verl.workers.rollout.vllm_rollout.utils", extension)


def _observe_tracking(folder: TrainerFolder) -> None:
    logged: dict[str, dict[str, Any]] = {}

    def tracking(module) -> None:
        log = module.Tracking.log

        def tracked(self, data, step, *args, **kwargs):
            logged[str(step)] = {k: _plain(v) for k, v in dict(data).items()}
            write_json(folder.step_metrics, logged)  # verl's own: {step: {name: value}}
            return log(self, data, step, *args, **kwargs)

        module.Tracking.log = tracked

    after_import("verl.utils.tracking", tracking)


def _plain(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def install() -> None:
    run = os.environ.get(RUN_DIR_VARIABLE)
    if not run:
        return  # verl imported outside a harness run
    folder = TrainerFolder(Path(run))
    spec = TrainerSpec.read(folder.spec)
    if spec.device_kind == DeviceKind.CPU:
        from pytest_fsdp_turbo_engine.trainer import cpu

        cpu.install(folder.path)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # verl's trainer workers set both
        _observe_trainer_rank(folder)
    _observe_replica(folder)
    _observe_tracking(folder)


install()
