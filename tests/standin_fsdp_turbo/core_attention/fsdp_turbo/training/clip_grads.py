from fsdp_turbo_standin_core import clip_grad_norm  # noqa: F401
