"""What the turbo_config generator needs to know and the pytest process may not import: the library's
config schema (from an FSDPTurbo checkout, importing only its config module and torch, so it runs
on any box) and the module tree of the model class actually loaded (on the meta device, no weights).

  python -m pytest_fsdp_turbo_engine.engines.turbo_inspect [--model DIR] [--checkout PATH]

prints {"layout", "schema", "modules"} as JSON. The FSDP-Turbo engine uses `schema_of` on the live
library too, so the rank validates against exactly what it imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import types
import typing
from pathlib import Path

CONFIG_MODULE = "fsdp_turbo.fsdp_turbo_config"


def _dataclass_in(annotation) -> type | None:
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):  # Optional[X], Union[X, None]
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def schema_of(cls: type) -> dict:
    """{field: {"required": bool, "fields": nested schema or None}} of a config dataclass."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
        hints = {}
    schema = {}
    for f in dataclasses.fields(cls):
        nested = _dataclass_in(hints.get(f.name, f.type))
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        schema[f.name] = {"required": required, "fields": schema_of(nested) if nested else None}
    return schema


def load_config_module(checkout: Path) -> types.ModuleType:
    """The checkout's config module without running `fsdp_turbo/__init__.py` (which may pull in
    torch_npu and the whole library)."""
    package = checkout / "fsdp_turbo"
    if not (package / "fsdp_turbo_config.py").is_file():
        raise FileNotFoundError(f"{package / 'fsdp_turbo_config.py'} does not exist")
    stub = types.ModuleType("fsdp_turbo")
    stub.__path__ = [str(package)]
    sys.modules["fsdp_turbo"] = stub
    return importlib.import_module(CONFIG_MODULE)


def module_plan(model) -> dict:
    """Decoder-layer, vision-block, embedding and LM-head names of `model`, as apply_modules
    patterns ({*} for a layer index). Decoder layers also become hook_modules."""
    import torch

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    layers, others = [], []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        kind = type(module[0]).__name__
        if kind in no_split or kind.endswith(("DecoderLayer", "Block")):
            (layers if kind.endswith("DecoderLayer") else others).append(f"{name}.{{*}}")
    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings()
    others.append(names[id(embed)])
    head = model.get_output_embeddings()
    if head is not None and head.weight is not embed.weight:  # a tied head is wrapped with embed
        others.append(names[id(head)])
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is not None:
        prefix = names[id(visual)]
        for child_name, child in visual.named_children():
            if not isinstance(child, torch.nn.ModuleList) and any(True for _ in child.parameters()):
                others.append(f"{prefix}.{child_name}")
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})
    return {
        "model_class": type(model).__name__,
        "layers": layers,
        "others": others,
        "classes": classes,  # what a `module.Class.member` patch target can match
        "functions": known_functions(),
        "names": [name for name, _ in model.named_modules()],  # what module patterns can match
    }


def known_functions() -> list[tuple[str, bool]]:
    """Whether each module-level function the harness's patch sets name exists (and is callable)
    in the installed transformers: a rename there would leave a Ulysses or loss patch unapplied."""
    from pytest_fsdp_turbo_contract.turbo_config import (
        LOSS_FUNCTIONS,
        ULYSSES_FUNCTIONS,
        class_of_target,
    )

    targets = {
        t for table in (ULYSSES_FUNCTIONS, LOSS_FUNCTIONS) for v in table.values() for t, _ in v
    }
    found = []
    for target in sorted(t for t in targets if class_of_target(t) is None):
        module, _, name = target.rpartition(".")
        try:
            exists = callable(getattr(importlib.import_module(module), name, None))
        except ImportError:
            exists = False
        found.append((target, exists))
    return found


def meta_model(model_dir: Path):
    import torch
    from transformers import AutoConfig

    from pytest_fsdp_turbo_engine.core.hf_model import from_config

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return from_config(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_fsdp_turbo_engine.engines.turbo_inspect"
    )
    parser.add_argument("--model", type=Path)
    parser.add_argument("--checkout", type=Path)
    args = parser.parse_args(argv)
    from pytest_fsdp_turbo_contract.turbo_config import detect_layout

    out: dict = {"layout": None, "schema": None, "modules": None}
    if args.checkout is not None:
        config_module = load_config_module(args.checkout)
        schema = schema_of(config_module.FSDPTurboConfig)
        # a stand-in declares what it cannot apply; the library declares nothing
        refused = getattr(config_module, "NOT_MODELLED", [])
        out.update(schema=schema, layout=detect_layout(schema), not_modelled=refused)
    if args.model is not None:
        out["modules"] = module_plan(meta_model(args.model))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
