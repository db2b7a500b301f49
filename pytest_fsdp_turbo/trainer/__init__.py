"""verl's own trainer (main_ppo) as a case kind: its cases, its resolved config, its runs (torch-free)."""
