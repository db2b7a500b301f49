"""Case kinds: one protocol (base.CaseKind), one implementation a module (ppo_step: the
harness's own PPO step; verl_trainer: verl's main_ppo), and the registry that reads the case file
through all of them (registry)."""
