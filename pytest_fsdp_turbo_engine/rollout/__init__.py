"""What generates the step's responses and scores them: the HF rollout, vLLM's, the weight hand-off
between trainer and rollout, and the reward."""
