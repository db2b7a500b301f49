"""A deliberately broken FSDP-Turbo engine for an SP mutant (see broken_turbo_sp_loss.py for why it
registers under backend "fsdp_turbo")."""

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SPAttentionNotPatchedEngine(FSDPTurboEngineWithLMHead):
    """Loads the model with sdpa attention while the library's Ulysses patch wraps the eager
    function: the patch is never called, and full attention runs on each rank's own chunk of the
    sequence, with no error at all."""

    def load_options(self) -> dict:
        return {"attn_implementation": "sdpa"}
