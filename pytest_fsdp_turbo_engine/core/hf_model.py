"""Which transformers class a checkpoint is loaded as, everywhere the harness loads one (engine,
rollout, reference, inspection, tiny builds, the warm parent).

verl loads a checkpoint whose config type has an image-text-to-text model as that model, and every
other one as a causal LM (verl.utils.model.get_hf_auto_model_class). A Qwen3.5 checkpoint is
vision-language: loaded that way it is a Qwen3_5ForConditionalGeneration whose module names
(`model.language_model.layers.N`, `model.visual.*`) and classes (`Qwen3_5Model`) are what
FSDPTurbo's patterns and patch targets are written against. Loading it as AutoModelForCausalLM
would give a different tree (`model.layers.N` under a Qwen3_5TextModel), so the harness follows verl.
"""

from __future__ import annotations

from pathlib import Path


def auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_pretrained(model_path: str | Path, **kwargs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)  # read once: it picks the class, and loads
    return auto_class(config).from_pretrained(model_path, config=config, **kwargs)


def from_config(config, **kwargs):
    return auto_class(config).from_config(config, **kwargs)
