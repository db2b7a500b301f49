"""The warm parent's parts (its entry point is pytest_fsdp_turbo_engine/warm_parent.py): what it
imports and exercises once (warm_up), what a forked rank does first (fork), and the server loop
that forks on request and reports exits, for the parent and its zygotes alike (server)."""
