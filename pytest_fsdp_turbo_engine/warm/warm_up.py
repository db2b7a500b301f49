"""What the warm parent pays once so its forked ranks do not: the imports, one CPU step of each
tiny model family, and whether forking stays safe after them."""

from __future__ import annotations

import contextlib
import json
import sys
import threading


def warm_up() -> None:
    """Everything a rank imports before its first phase, except device runtimes: torch, FSDP2,
    transformers, the engine, and the modeling modules of the tiny model families."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from pytest_fsdp_turbo_fixtures import DATA_DIR
    from transformers import (  # noqa: F401
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,  # noqa: F401
    )

    from pytest_fsdp_turbo_engine import worker  # noqa: F401
    from pytest_fsdp_turbo_engine.step import run  # noqa: F401

    for spec in sorted((DATA_DIR / "models").glob("*.json")):
        family = json.loads(spec.read_text())["model_type"].removesuffix("_text")
        with contextlib.suppress(ImportError):  # an older transformers lacks it: ranks import it
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def exercise() -> None:
    """One forward, backward and AdamW step of each tiny model family, built from its spec on the
    CPU, with no process group and no device: the lazy imports and first-call set-up of
    transformers, autograd and the optimizer are then paid here once, not in every rank (about
    0.2 s a rank). Nothing of it survives but warm code paths: the models are dropped and the RNG
    state is put back, so a rank's seeded draws are what they would have been."""
    import torch
    from pytest_fsdp_turbo_fixtures import DATA_DIR

    from pytest_fsdp_turbo_engine.core.hf_model import from_config
    from pytest_fsdp_turbo_engine.tiny_models import tiny_config

    rng = torch.random.get_rng_state()
    try:
        for spec_path in sorted((DATA_DIR / "models").glob("*.json")):
            spec = json.loads(spec_path.read_text())
            model = from_config(tiny_config(spec, vocab_size=64), dtype=torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(input_ids=torch.randint(0, 64, (2, 8))).logits.float().sum().backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=False)
            optimizer.step()
            del model, optimizer
    except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation, never a failure
        sys.stderr.write(f"warm parent: warm-up step skipped: {type(exc).__name__}: {exc}\n")
    finally:
        torch.random.set_rng_state(rng)


def fork_unsafe_reason() -> str | None:
    """Why forking ranks from this process would be unsafe, or None."""
    import torch

    if "torch_npu" in sys.modules:
        return "torch_npu is imported (its runtime does not survive fork)"
    if torch.cuda.is_initialized():
        return "a CUDA context exists"
    if threading.active_count() > 1:
        return f"{threading.active_count()} threads are running"
    return None
