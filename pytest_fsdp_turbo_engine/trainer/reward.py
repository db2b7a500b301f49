"""The tiny trainer cases' reward: verl loads this file as its custom reward function
(`reward.custom_reward_function.path`). A rule like gsm8k's scores a random model 0 everywhere, so
advantages and gradients would be 0; this one is continuous in every response character's distance
to the target character, so the responses of one GRPO group score apart."""

from __future__ import annotations

import math


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    if not solution_str:
        return 0.0
    target = ord(str(ground_truth)[:1] or " ")
    return sum(math.exp(-abs(ord(c) - target) / 32) for c in solution_str) / len(solution_str)
