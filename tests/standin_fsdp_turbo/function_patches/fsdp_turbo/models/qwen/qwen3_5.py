"""STAND-IN: the module patch replacement the Qwen3.5 SP configs name (see the stand-in's Ulysses)."""

from fsdp_turbo_standin_ulysses import qwen3_5_model_forward  # noqa: F401
