from fsdp_turbo_standin_core import FSDPTurbo  # noqa: F401
