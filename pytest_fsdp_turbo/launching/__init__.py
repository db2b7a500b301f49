"""From a case to a run: resolve and gate it (case_runner), lease, build the env and spec
(request), start and follow the ranks (supervisor; warm forks them, ray_driver and ray_ranks run
them as Ray actors), show progress, and own the session's long-lived processes."""
