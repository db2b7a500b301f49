"""A deterministic, dense rule-based reward on a synthetic task.

Task: "answer with characters close to the target character". The reward is the mean closeness of every
response byte to the target, so even a random-init model gets distinct rewards within a group and GRPO
advantages (hence gradients) are non-zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo_fixtures import DATA_DIR

PROMPTS_DIR = DATA_DIR / "prompts"


@dataclass(frozen=True)
class Prompt:
    text: str
    target: str


def load_prompts(name: str = "nearest_char", directory: Path | None = None) -> list[Prompt]:
    path = (directory or PROMPTS_DIR) / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [Prompt(row["prompt"], row["target"]) for row in rows]
    lengths = {len(p.text.encode()) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(
            f"{path}: every prompt must have the same byte length; got {sorted(lengths)}"
        )
    return prompts


def closeness_reward(response: bytes, target: str) -> float:
    """Mean over bytes of 1 - |byte - target| / 255; an empty response scores 0."""
    if not response:
        return 0.0
    goal = ord(target)
    return sum(1.0 - abs(b - goal) / 255.0 for b in response) / len(response)
