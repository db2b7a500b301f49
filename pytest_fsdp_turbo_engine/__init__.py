"""Rank-side code (imports torch): engines, PPO step, rollout, reward, tiny models."""
