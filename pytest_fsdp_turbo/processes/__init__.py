"""The session's processes, below every case kind: the supervisor (start a process tree, follow
it, stop and reap it), the warm parent that forks ranks, and the owner of the long-lived ones."""
