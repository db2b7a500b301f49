"""Rollout through vLLM (CUDA) or vllm-ascend (NPU), behind the same interface as HFRollout.

Thin on purpose: vLLM cannot run on a CPU box, and its internals move between releases. The engine
runs in-process (no engine-core subprocess) so the trainer can push weights into it after the step.
"""

from __future__ import annotations

import os

import torch
from pytest_fsdp_turbo_engine.rollout import RolloutBatch, response_mask

# Where the torch module lives inside an in-process LLM, across the releases we know of.
_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.model_runner.model",
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
    def __init__(self, model_path: str, eos_id: int, pad_id: int, dtype: str, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm_cls, self.sampling = _import_vllm()
        self.llm = llm_cls(
            model=model_path,
            dtype="bfloat16" if dtype == "bf16" else "float32",
            enforce_eager=True,
            gpu_memory_utilization=float(os.environ.get("PYTEST_FSDP_TURBO_VLLM_MEMORY", "0.3")),
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

    def _model(self) -> torch.nn.Module:
        for path in _MODEL_PATHS:
            target = self.llm
            try:
                for part in path.split("."):
                    target = getattr(target, part)
            except AttributeError:
                continue
            return target
        raise RuntimeError(
            f"cannot reach the vLLM model to load weights; tried: {', '.join(_MODEL_PATHS)}"
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._model().load_weights(weights=state_dict.items())

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
