"""The contract between the pytest plugin and its ranks, torch-free, imported by both sides and
importing neither: what a rank is asked to do (`spec`), what it measured (`records`), what it left
behind (`artifacts`), how a run ended (`results`), and the names both sides share (`vocab`,
`errors`, `faults`, `bounds`, `turbo_config`, `lifetime`)."""
