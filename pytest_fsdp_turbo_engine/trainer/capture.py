"""What the reference replays of each optimizer step, captured from outside verl at its engine's
public seams (observer.py calls these): each rank's mini-batch as `train_batch` got it, the
gradient verl's loss sent into each row's log-probs, and on rank 0 the parameters before the step,
the raw gradients after the last backward and the parameters after the step, each gathered whole.
Only when the case declares its reference; one `.pt` file per reading under observe/capture/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# the mini-batch's fields the reference reads (verl 0.9.1's actor hands them to train_batch)
BATCH_FIELDS = (
    "input_ids",
    "prompts",
    "responses",
    "response_mask",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    "rollout_is_weights",
)


def save(path: Path, value: Any) -> None:
    """Written whole or not at all: a reader never sees half a file."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(value, scratch)
    os.replace(scratch, path)


def rows_of(value) -> list:
    """A nested (jagged) tensor's rows, or a padded tensor's, each on the CPU."""
    rows = value.unbind() if getattr(value, "is_nested", False) else list(value)
    return [row.detach().cpu() for row in rows]


def response_rows(value, lengths: list[int]) -> list:
    """Each row's first `length` entries: a padded response-wide field as per-row tensors."""
    return [row[:length] for row, length in zip(rows_of(value), lengths)]


def mini_batch(data) -> dict[str, Any]:
    """The mini-batch as per-row tensors: full sequences (prompt then response), and the
    response-wide fields cut to each row's response length. Padded (non-nested) input is refused
    by name: the reference reads verl's no-padding layout."""
    ids = data.get("input_ids", None)
    if ids is None or not getattr(ids, "is_nested", False):
        return {"refused": "the mini-batch's input_ids are not verl's no-padding (nested) layout"}
    prompts = [len(row) for row in rows_of(data["prompts"])]
    responses = [len(row) for row in rows_of(data["responses"])]
    out: dict[str, Any] = {
        "input_ids": rows_of(ids),
        "prompt_lengths": prompts,
        "response_lengths": responses,
    }
    for name in BATCH_FIELDS[3:]:
        value = data.get(name, None)
        if value is not None:
            out[name] = response_rows(value, responses)
    out["temperature"] = temperature_of(data.get("temperature", None))
    return out


def temperature_of(value) -> Any:
    """verl's sampling temperature: a number (tensordict's NonTensorData holds it in `.data`) or
    one per row."""
    value = getattr(value, "data", value)
    if hasattr(value, "detach"):
        return value.detach().float().cpu()
    return 1.0 if value is None else float(value)


def response_slices(data) -> list[tuple[int, int]]:
    """Where each row's response log-probs sit in a micro-batch's flat (no-padding) output: the
    token before each response token predicts it."""
    prompts = [len(row) for row in rows_of(data["prompts"])]
    responses = [len(row) for row in rows_of(data["responses"])]
    slices, end = [], 0
    for prompt, response in zip(prompts, responses):
        end += prompt + response
        slices.append((end - response - 1, end - 1))
    return slices
