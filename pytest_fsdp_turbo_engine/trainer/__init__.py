"""The rank side of verl trainer runs: the entry that starts main_ppo, the observer verl imports in every process, and what only a CPU box needs."""
