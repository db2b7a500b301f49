"""Broken engines for verl's own trainer, each one plausible bug away from verl's FSDP2 engine, and
each registered the way a downstream engine is: in verl's EngineRegistry, for the CPU platform's
vendor ("cpu"), which verl's lookup tries before its own cuda entry. The trainer imports this
module in every process (a trainer case's `external_modules`); the environment variable below says
which bug this run carries.

- noop_sync: the seed PR's bug. `_gradient_sync_context` does nothing, so under a config that
  declares deferral every micro-batch still reduce-scatters and nothing is held (check h).
- stale_push: rank 1 hands its rollout replica the weights of the first push again after the
  step, a stale push into one replica (check e). It still walks the fresh generator, whose
  full_tensor() gathers are collectives every rank must join.
- skip_clip: the clip runs with max_norm = inf, so the engine reports the true norm and steps on
  the raw gradients (check k; a still holds: the norm is true).
- zero_loss: the loss verl hands the engine is multiplied by 0 before backward: no gradient,
  though the advantages are not 0 (check a).
- all_reduce_each: deferral declared and kept (FSDP2 reduce-scatters on the last micro-batch
  alone), but after each earlier micro-batch's backward the engine all-reduces, and averages,
  every unsharded gradient FSDP2 holds: the same gradients, a sync every micro-batch at an
  all-reduce's cost, which the reduce-scatter counts never see (check h: every collective that
  carried gradients).
- half_grads: FSDP2's gradient divide factor is twice the world size (an average taken twice):
  the norm it reports is the true norm of what it holds, the clip right, the loss gradient right,
  and AdamW's first update nearly scale-free; only the reference sees it (c, and a's reference
  norm).
- scaled_lr: the optimizer's lr multiplied by the data-parallel size once more (check i: the
  update against AdamW at the resolved lr on the engine's own gradients).
- cold_logprobs: the log-prob pass runs at temperature 1 while the rollout and the loss use the
  case's (check b: verl's old log-probs against the reference's forward).
- never_steps: optimizer_step clips and reports the norm but never calls the optimizer's step
  (the run's failure, first line: the engine trained and the optimizer never stepped).
- cold_ref: the same, on the reference policy's pass alone (verl's forward-only engine): the KL
  loss is taken against the reference policy at temperature 1 (check b: its log-probs against
  the reference's forward at the checkpoint's parameters).
- stale_onload: every mini-batch after the first starts from the parameters the engine saved at
  the first, as an offload that restores a stale copy would: each optimizer step moves the
  weights from the checkpoint again (check i: the parameters before a step against where the
  previous step left them).
- last_micro_batch_only: the gradients zeroed as each micro-batch begins (a zero_grad moved into
  the micro-batch loop): only the last micro-batch's reach the step, whose norm is reported,
  clipped and stepped on faithfully (check h: the micro-batch pair, one pass of the same
  mini-batch against its k micro-batches).
Several bugs may share one run, `a+b`, when the checks they turn red are disjoint, or when they
fall on different optimizer steps: `bug@N` (noop_sync, zero_loss, all_reduce_each) is on step N
alone (the N-th mini-batch, from 0), and each step is judged on its own.
"""

from __future__ import annotations

import contextlib
import os

from pytest_fsdp_turbo_engine.trainer.imports import after_import

BUG = "PYTEST_FSDP_TURBO_TRAINER_BUG"


def _register(transformer_impl) -> None:
    import torch.distributed as dist
    from verl.workers.engine.base import EngineRegistry

    base = transformer_impl.FSDPEngineWithLMHead
    bug = os.environ.get(BUG, "")

    class OnOneStep(base):
        """A bug that `bug@N` puts on the N-th mini-batch alone (bug name -> N; none: every one)."""

        bug_steps: dict[str, int] = {}
        _mini_batches = -1

        def train_batch(self, data, loss_function):
            self._mini_batches += 1
            return super().train_batch(data, loss_function)

        def _bug_now(self, name: str) -> bool:
            return self.bug_steps.get(name, self._mini_batches) == self._mini_batches

    class NoopSyncEngine(OnOneStep):
        @contextlib.contextmanager
        def _gradient_sync_context(self, *, is_last_micro_batch: bool):
            if not self._bug_now("noop_sync"):
                with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
                    yield
                return
            yield

    class AllReduceEachEngine(OnOneStep):
        @contextlib.contextmanager
        def _gradient_sync_context(self, *, is_last_micro_batch: bool):
            with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
                yield
            if is_last_micro_batch or not self._bug_now("all_reduce_each"):
                return
            from torch.distributed.fsdp import FSDPModule

            world = dist.get_world_size()
            for unit in self.module.modules():
                if not isinstance(unit, FSDPModule):
                    continue
                group = unit._get_fsdp_state()._fsdp_param_group
                for param in group.fsdp_params if group else ():
                    grad = param.unsharded_accumulated_grad
                    unsharded = getattr(param, "_unsharded_param", None)
                    if grad is None and unsharded is not None:
                        grad = unsharded.grad
                    if grad is not None:
                        dist.all_reduce(grad)
                        grad.div_(world)

    class StalePushEngine(base):
        def get_per_tensor_param(self, *args, **kwargs):
            fresh, peft = super().get_per_tensor_param(*args, **kwargs)
            if dist.get_rank() != 1:
                return fresh, peft
            first = not hasattr(self, "_first_push")
            if first:
                self._first_push = {}

            def stale():
                for name, tensor in fresh:
                    if first:
                        self._first_push[name] = tensor.detach().clone()
                    yield name, self._first_push.get(name, tensor)

            return stale(), peft

    class SkipClipEngine(base):
        def optimizer_step(self):
            clip = transformer_impl.fsdp2_clip_grad_norm_

            def unclipped(parameters, max_norm, *args, **kwargs):
                return clip(parameters, float("inf"), *args, **kwargs)

            transformer_impl.fsdp2_clip_grad_norm_ = unclipped
            try:
                return super().optimizer_step()
            finally:
                transformer_impl.fsdp2_clip_grad_norm_ = clip

    class ZeroLossEngine(OnOneStep):
        def forward_backward_batch(self, data, loss_function, forward_only=False):
            if forward_only or loss_function is None or not self._bug_now("zero_loss"):
                return super().forward_backward_batch(data, loss_function, forward_only)

            def zeroed(**kwargs):
                loss, metrics = loss_function(**kwargs)
                return loss * 0.0, metrics

            return super().forward_backward_batch(data, zeroed, forward_only)

    class HalfGradsEngine(base):
        """FSDP2 told to divide the gradient by twice the world size: every reduced gradient is
        half, its norm is reported and clipped faithfully, AdamW's first step barely moves."""

        def initialize(self):
            super().initialize()
            import torch.distributed as dist
            from torch.distributed.fsdp import FSDPModule

            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(2.0 * dist.get_world_size())
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    class ScaledLrEngine(base):
        """The learning rate scaled by the data-parallel size (a linear scaling rule verl's
        config already applied): the engine steps at twice the resolved lr on 2 ranks."""

        def initialize(self):
            super().initialize()
            for group in self.optimizer.param_groups:
                group["lr"] *= dist.get_world_size()

    class ColdLogprobEngine(base):
        """The log-prob pass drops the rollout's temperature: the old log-probs are the policy's
        at temperature 1 while the rollout sampled, and the loss trains, at another."""

        def infer_batch(self, data, loss_function=None):
            from verl.utils import tensordict_utils as tu

            data = data.copy()  # the caller's batch keeps its temperature
            tu.assign_non_tensor(data, temperature=1.0)
            return super().infer_batch(data, loss_function)

    class NeverStepsEngine(base):
        def optimizer_step(self):
            step = self.optimizer.step
            self.optimizer.step = lambda *args, **kwargs: None
            try:
                return super().optimizer_step()
            finally:
                self.optimizer.step = step

    class ColdRefEngine(base):
        """The reference policy's log-prob pass (the forward-only engine) drops the temperature."""

        def infer_batch(self, data, loss_function=None):
            from verl.utils import tensordict_utils as tu

            if self.engine_config.forward_only:
                data = data.copy()
                tu.assign_non_tensor(data, temperature=1.0)
            return super().infer_batch(data, loss_function)

    class StaleOnloadEngine(base):
        """Restores the parameters it saved on its first mini-batch before every later one."""

        def train_batch(self, data, loss_function):
            import torch

            params = list(self.module.parameters())
            with torch.no_grad():
                if not hasattr(self, "_saved"):
                    self._saved = [p.detach().clone() for p in params]
                else:
                    for param, saved in zip(params, self._saved):
                        param.copy_(saved)
            return super().train_batch(data, loss_function)

    class LastMicroBatchOnlyEngine(base):
        @contextlib.contextmanager
        def _gradient_sync_context(self, *, is_last_micro_batch: bool):
            self.optimizer_zero_grad()
            with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
                yield

    engines = {
        "noop_sync": NoopSyncEngine,
        "stale_push": StalePushEngine,
        "skip_clip": SkipClipEngine,
        "zero_loss": ZeroLossEngine,
        "all_reduce_each": AllReduceEachEngine,
        "half_grads": HalfGradsEngine,
        "scaled_lr": ScaledLrEngine,
        "cold_logprobs": ColdLogprobEngine,
        "never_steps": NeverStepsEngine,
        "cold_ref": ColdRefEngine,
        "stale_onload": StaleOnloadEngine,
        "last_micro_batch_only": LastMicroBatchOnlyEngine,
    }
    chosen, steps = [], {}
    for each in bug.split("+"):
        name, at, step = each.partition("@")
        if name not in engines:
            raise ValueError(f"{BUG}={bug!r}: {name!r} is none of {', '.join(engines)}")
        if at and (not issubclass(engines[name], OnOneStep) or not step.isdigit()):
            raise ValueError(
                f"{BUG}={bug!r}: {name!r} takes no @STEP (a number after noop_sync, zero_loss or "
                f"all_reduce_each), not {each!r}"
            )
        if engines[name] in chosen:
            raise ValueError(f"{BUG}={bug!r}: {name!r} twice; one engine carries each bug once")
        if at:
            steps[name] = int(step)
        chosen.append(engines[name])
    # several bugs, one run (verl's start-up paid once): each on a check or a step of its own; the
    # class is named after the bugs' (the run names the engine it built)
    engine = type("_".join(b.__name__ for b in chosen), tuple(chosen), {"bug_steps": steps})
    EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda", vendor="cpu"
    )(engine)


after_import("verl.workers.engine.fsdp.transformer_impl", _register)
