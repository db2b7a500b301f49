"""Tiny LMs (causal, or vision-language where the real checkpoints are) built from specs in
fixtures/models, saved in HF format and loaded like real ones.

The builder runs once per session (the plugin calls it in a subprocess under a lock); ranks load the
result with `from_pretrained`, the same path a real checkpoint takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pytest_fsdp_turbo_fixtures import DATA_DIR

from pytest_fsdp_turbo_contract.errors import SPEC_ERROR_EXIT

SPECS_DIR = DATA_DIR / "models"
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
# A spec with "chat": true gets Qwen's turn markers and chat template: verl's trainer renders
# chat-style prompts with the tokenizer's template and requires Qwen models' <|im_end|>. Other specs
# keep the two special tokens (their vocabulary, hence their weights and goldens, stay as they are).
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_spec(name: str, directory: Path | None = None) -> dict:
    path = (directory or SPECS_DIR) / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in (directory or SPECS_DIR).glob("*.json"))
        raise FileNotFoundError(
            f"tiny model spec {name!r} not found in {path.parent}; known: {known}"
        )
    return json.loads(path.read_text())


def build_byte_tokenizer(chat: bool = False):
    """A byte-level tokenizer with no merges: every byte is a token, plus EOS and PAD (and with
    `chat`, Qwen's turn markers and a chat template)."""
    specials = SPECIAL_TOKENS + (CHAT_TOKENS if chat else ())
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for token in specials:
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1]
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _pin_version_sensitive_init(model) -> None:
    """Parameters whose HF initialisation changed between transformers releases get fixed values,
    so a spec builds the same weights (and matches its goldens) on every supported version. Seen:
    gated delta-net A_log (log of a uniform draw) differs between transformers 5.10 and 5.24."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.linspace(1.0, 16.0, param.numel()).log().view_as(param))


def tiny_config(
    recipe: dict, vocab_size: int, eos_id: int | None = None, pad_id: int | None = None
):
    """The HF config of a spec. A vision-language spec (a `text_config` inside) gets the vocabulary
    and special tokens in its text config, where the language model reads them."""
    from transformers import AutoConfig

    tokens = {"vocab_size": vocab_size}
    if eos_id is not None:
        tokens.update(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id)
    fields = dict(recipe["config"])
    if "text_config" in fields:
        fields["text_config"] = {**fields["text_config"], **tokens}
        return AutoConfig.for_model(recipe["model_type"], **fields)
    return AutoConfig.for_model(recipe["model_type"], **tokens, **fields)


def build_tiny_model(name: str, out_dir: Path, spec_dir: Path | None = None) -> Path:
    import torch

    from pytest_fsdp_turbo_engine.core.hf_model import from_config

    spec = load_spec(name, spec_dir)
    tokenizer = build_byte_tokenizer(chat=spec.get("chat", False))
    config = tiny_config(spec, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(spec.get("seed", 0))
    model = from_config(config, dtype=torch.float32)
    _pin_version_sensitive_init(model)
    if stops := spec.get("stop_bytes"):
        # A random tiny model almost never samples its EOS (1 in the vocabulary), so every
        # response would run to the length limit; these bytes end a response too (a list of EOS
        # ids, as Qwen's own generation config has), so responses come in varied lengths.
        ids = [tokenizer.convert_tokens_to_ids(ch) for ch in stops]
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *ids]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


TINY_BYTES_MAX = 1 << 30  # fp32 weights a tiny spec may hold: far above any test's, far below RAM


class SpecError(ValueError):
    """A tiny spec that cannot build a model, or one too big to be tiny."""


def check_spec(name: str, spec_dir: Path | None = None) -> None:
    """The spec's model built on the meta device (no memory): its fields are what transformers
    accepts and its weights fit TINY_BYTES_MAX, before anything is allocated."""
    import torch

    from pytest_fsdp_turbo_engine.core.hf_model import from_config

    path = (spec_dir or SPECS_DIR) / f"{name}.json"
    try:
        spec = load_spec(name, spec_dir)
        if not isinstance(spec, dict) or not isinstance(spec.get("config"), dict):
            raise SpecError("expected a JSON object with a 'config' table")
        config = tiny_config(spec, 260)
        with torch.device("meta"):
            model = from_config(config, dtype=torch.float32)
    except SpecError as exc:
        raise SpecError(f"tiny model spec {path}: {exc}") from None
    except (ImportError, KeyError):  # this transformers lacks the model: not the spec's fault
        raise
    except ValueError as exc:
        if "model_type" in str(exc) or "Unrecognized" in str(exc):
            raise  # an architecture this transformers does not know: the case skips, as before
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        raise SpecError(f"tiny model spec {path}: {type(exc).__name__}: {said}") from None
    except Exception as exc:  # noqa: BLE001 - transformers' own words, in one line
        said = (str(exc).strip().splitlines() or [""])[0][:300]
        raise SpecError(f"tiny model spec {path}: {type(exc).__name__}: {said}") from None
    size = sum(p.numel() for p in model.parameters()) * 4
    if size > TINY_BYTES_MAX:
        raise SpecError(
            f"tiny model spec {path}: its weights would take {size / 2**30:.1f} GiB in fp32; a "
            f"tiny spec stays under {TINY_BYTES_MAX / 2**30:.0f} GiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="build a tiny HF model from a fixtures spec")
    parser.add_argument("name")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--spec-dir", type=Path, help=f"where NAME.json is (default {SPECS_DIR})")
    args = parser.parse_args()
    try:
        check_spec(args.name, args.spec_dir)
    except (SpecError, OSError, json.JSONDecodeError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(SPEC_ERROR_EXIT)
    print(build_tiny_model(args.name, args.out_dir, args.spec_dir))


if __name__ == "__main__":
    main()
