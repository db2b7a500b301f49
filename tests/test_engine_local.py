"""Engine pieces on a real single-rank gloo process group inside this test process."""

import json
import re

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from pytest_fsdp_turbo.environ import restored_environ  # noqa: E402
from pytest_fsdp_turbo.models import ModelUnavailable, local_model_dir  # noqa: E402
from pytest_fsdp_turbo_contract.spec import EngineSpec  # noqa: E402
from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead  # noqa: E402
from pytest_fsdp_turbo_engine.rollout.hf_rollout import response_mask  # noqa: E402
from pytest_fsdp_turbo_engine.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_env_side_effects():
    """torch sets TORCHINDUCTOR_CACHE_DIR on first use in-process; keep the env guard honest."""
    with restored_environ():
        yield


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder(FSDPEngineWithLMHead):
    def _set_gradient_sync(self, enabled):
        self.toggles.append(enabled)
        super()._set_gradient_sync(enabled)


def make_engine(policy):
    from torch.distributed.fsdp import fully_shard

    engine = Recorder(
        EngineSpec(world_size=1, fsdp_size=1, gradient_sync=policy), torch.device("cpu")
    )
    engine.toggles = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model[0], mesh=engine.mesh)
    engine.module = fully_shard(model, mesh=engine.mesh)
    engine.optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return engine


def reduce_flags(engine):
    return [
        m._get_fsdp_state()._fsdp_param_group.reduce_grads
        for m in (engine.module, engine.module[0])
    ]


def test_sync_context_order(process_group):
    deferred = make_engine("deferred")
    with deferred.gradient_sync_context(is_last_micro_batch=False):
        assert reduce_flags(deferred) == [False, False]
    with deferred.gradient_sync_context(is_last_micro_batch=True):
        assert reduce_flags(deferred) == [True, True]
    assert deferred.toggles == [False, True, True, True]
    every = make_engine("every_micro_batch")
    with every.gradient_sync_context(is_last_micro_batch=False):
        assert reduce_flags(every) == [True, True]
    assert every.toggles == [True, True]


def test_sync_context_restores_on_exception(process_group):
    engine = make_engine("deferred")
    with (
        pytest.raises(RuntimeError, match="backward blew up"),
        engine.gradient_sync_context(is_last_micro_batch=False),
    ):
        raise RuntimeError("backward blew up")
    assert engine.toggles == [False, True]
    assert reduce_flags(engine) == [True, True]


def test_probe_sees_unsharded_grads_only_under_deferred_sync(process_group):
    from pytest_fsdp_turbo_engine.step import fsdp_probe

    for policy, retained in (("deferred", (16 + 4 + 4 + 1) * 4), ("every_micro_batch", 0)):
        engine = make_engine(policy)
        with engine.gradient_sync_context(is_last_micro_batch=False):
            engine.module(torch.randn(3, 4)).sum().backward()
        assert fsdp_probe.unsharded_grad_bytes(engine.module) == retained, policy
        assert fsdp_probe.fsdp_units(engine.module) == 2  # the root owns the second Linear
        assert fsdp_probe.shard_group_size(engine.module) == 1


def test_probe_norm_is_the_global_l2_norm(process_group):
    from pytest_fsdp_turbo_engine.step import fsdp_probe

    engine = make_engine("every_micro_batch")
    engine.module(torch.randn(3, 4)).sum().backward()
    grads = [p.grad.full_tensor().double() for p in engine.module.parameters()]
    want = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    assert fsdp_probe.global_grad_norm(engine.module) == pytest.approx(float(want), rel=1e-12)


def test_probe_names_the_torch_version_when_fsdp_internals_move(process_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from pytest_fsdp_turbo_engine.step import fsdp_probe

    engine = make_engine("deferred")
    monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
    with pytest.raises(
        fsdp_probe.FSDPInternalsChanged, match=re.escape(f"torch {torch.__version__}:")
    ):
        fsdp_probe.unsharded_grad_bytes(engine.module)


def test_optimizer_step_skips_non_finite(process_group):
    engine = make_engine("deferred")
    engine.module(torch.randn(2, 4)).sum().backward()
    before = [p.detach().to_local().clone() for p in engine.module.parameters()]
    next(engine.module.parameters()).grad.to_local()[0, 0] = float("nan")
    norm = engine.optimizer_step()
    assert norm != norm  # NaN is reported, not hidden
    after = [p.detach().to_local() for p in engine.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(p.grad is None for p in engine.module.parameters())
    engine.module(torch.randn(2, 4)).sum().backward()
    norm = engine.optimizer_step()
    assert norm > 0 and not torch.equal(
        before[0], next(engine.module.parameters()).detach().to_local()
    )


def test_response_mask_cuts_after_first_eos():
    ids = torch.tensor([[5, 9, 6, 9], [1, 2, 3, 4]])
    assert response_mask(ids, eos_id=9).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_a_chat_spec_stop_bytes_end_responses_as_eos_ids_do(tmp_path):
    """vLLM stops at every id of generation_config's eos_token_id: the trainer cases' responses
    vary in length only because the spec's bytes are there."""
    from transformers import AutoTokenizer

    out = build_tiny_model("tiny-qwen3-chat", tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos[0] == tokenizer.eos_token_id
    letters = tokenizer("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False).input_ids
    assert sorted(eos[1:]) == sorted(letters) and len(letters) == 26
    assert tokenizer("A", add_special_tokens=False).input_ids[0] not in eos


def test_tiny_model_builder_saves_hf_format(tmp_path):
    from transformers import AutoTokenizer

    from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained

    out = build_tiny_model("tiny-qwen3_5", tmp_path / "m")
    assert local_model_dir("m", tmp_path) == out  # complete: config and weights
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    # vision-language, as the real Qwen3.5 checkpoints are: loaded as what verl loads
    assert config["model_type"] == "qwen3_5" and config["vision_config"]["depth"] == 1
    assert set(config["text_config"]["layer_types"]) == {"linear_attention", "full_attention"}
    model = load_pretrained(out)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("héllo", add_special_tokens=False).input_ids) == "héllo"
    again = load_pretrained(build_tiny_model("tiny-qwen3_5", tmp_path / "m2"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name  # fixed seed: the same weights every build
    # init that changed between transformers releases is pinned, so goldens hold on every version
    a_log = model.state_dict()["model.language_model.layers.0.linear_attn.A_log"]
    assert torch.equal(a_log, torch.linspace(1.0, 16.0, a_log.numel()).log())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailable, match="incomplete"):
        local_model_dir("empty", tmp_path)


class _TwoOfThree(torch.nn.Module):
    """Three units, one of which never runs forward (as a vision tower on a text batch)."""

    def __init__(self):
        super().__init__()
        self.first, self.unused, self.last = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        return self.last(self.first(x))


def _deferred_bf16_steps(materialize: bool) -> torch.Tensor:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from pytest_fsdp_turbo_engine.engines.fsdp2 import materialize_unsharded_params

    torch.manual_seed(0)
    model = _TwoOfThree()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in (model.first, model.unused, model.last, model):
        fully_shard(unit, mp_policy=policy)
    if materialize:
        materialize_unsharded_params(model)
    x = torch.randn(2, 4)
    for last in (False, True):  # deferred: no reduce-scatter on the first micro-batch
        model.set_requires_gradient_sync(last)
        model(x).float().sum().backward()
    assert model.unused.weight.grad is None
    return model.first.weight.grad.full_tensor()


def test_units_that_never_run_forward_survive_deferred_bf16_sync(process_group):
    """FSDP2's final post-backward reads the unsharded parameters of a unit that never ran forward
    (torch 2.11 to 2.14, pytorch#194058); the engine's materialize_unsharded_params prevents it."""
    with pytest.raises(AttributeError, match="_unsharded_param"):
        _deferred_bf16_steps(materialize=False)
    grad = _deferred_bf16_steps(materialize=True)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_sp_boundaries_count_response_tokens_a_chunk_starts_on():
    """Rows of 4 prompt + 6 response tokens, split 2 ways: padded rows are each split at 5 (the
    second response token); a packed micro-batch of 2 rows splits between them (a prompt token);
    of 3 rows, at 15, inside the middle row (its second response token). Masked tokens (after EOS)
    do not count."""
    from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch
    from pytest_fsdp_turbo_engine.step.measurements import sp_boundaries_in_responses

    def batch(rows: int, mask_row0=None) -> TrainBatch:
        mask = torch.ones(rows, 6)
        if mask_row0 is not None:
            mask[0] = torch.tensor(mask_row0)
        zeros = torch.zeros(rows, 6)
        return TrainBatch(torch.zeros(rows, 10, dtype=torch.long), 4, mask, zeros, zeros, zeros)

    assert sp_boundaries_in_responses(batch(2), sp=2, micro_batches=1, packed=False) == 2
    assert sp_boundaries_in_responses(batch(2, [1, 0, 0, 0, 0, 0]), 2, 1, packed=False) == 1
    assert sp_boundaries_in_responses(batch(2), sp=2, micro_batches=1, packed=True) == 0
    assert sp_boundaries_in_responses(batch(3), sp=2, micro_batches=1, packed=True) == 1
    assert sp_boundaries_in_responses(batch(6), sp=2, micro_batches=2, packed=True) == 2
    assert sp_boundaries_in_responses(batch(1), sp=4, micro_batches=1, packed=False) == 2


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {
                "hidden_size": 65536,
                "intermediate_size": 262144,
                "num_hidden_layers": 64,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 1024,
            },
            "its weights would take ",
        ),
        ({"hidden_size": 64, "num_attention_heads": 4, "head_dim": "wide"}, "head_dim"),
        (None, "expected a JSON object with a 'config' table"),
    ],
)
def test_a_tiny_spec_too_big_or_wrong_is_one_line_before_anything_is_allocated(
    tmp_path, config, said
):
    """Checked on the meta device first: a spec of about 100 GiB is refused by its size, a field
    transformers refuses is named in transformers' words, each in one line naming the spec file;
    through the builder the pytest side gets exactly that line, as a failure (the first case)."""
    from pytest_fsdp_turbo.models import build_tiny_model as build
    from pytest_fsdp_turbo_contract.errors import ConfigError
    from pytest_fsdp_turbo_engine.tiny_models import SpecError, check_spec

    specs = tmp_path / "specs"
    specs.mkdir()
    spec = {"model_type": "qwen3", "seed": 1} | ({"config": config} if config else {})
    (specs / "tiny-bad.json").write_text(json.dumps(spec))
    with pytest.raises(SpecError) as checked:
        check_spec("tiny-bad", specs)
    message = str(checked.value)
    assert message.startswith(f"tiny model spec {specs / 'tiny-bad.json'}: ") and said in message
    assert "\n" not in message
    if "weights would take" in said:  # the whole path once: builder subprocess, exit code, line
        with pytest.raises(ConfigError) as refused:
            build("tiny-bad", tmp_path / "cache", tiny_models=specs)
        assert str(refused.value) == message
        assert not list((tmp_path / "cache").glob("tiny-bad*/config.json"))


def test_every_shipped_tiny_spec_passes_the_check():
    from pytest_fsdp_turbo_engine.tiny_models import SPECS_DIR, check_spec

    for path in sorted(SPECS_DIR.glob("*.json")):
        check_spec(path.stem)
