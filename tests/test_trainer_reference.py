"""The trainer reference's loss (pytest_fsdp_turbo_engine/trainer/verl_loss.py), written from verl's
documentation, against verl's own functions on the same tensors: every aggregation, the clip with
dual clip, every KL type, the entropy bonus; and what it refuses, by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from pytest_fsdp_turbo_engine.trainer import verl_loss  # noqa: E402
from pytest_fsdp_turbo_engine.trainer.verl_loss import Unmodelled  # noqa: E402

ACTOR = verl_loss.ACTOR


def _config(**actor) -> dict:
    """A resolved config holding the actor's keys (dots as `__`)."""
    return _nested(**{f"actor_rollout_ref__actor__{key}": value for key, value in actor.items()})


def _batch(rows: int = 6, width: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=gen) * 3
    logprobs = old + torch.randn(rows, width, generator=gen) * 0.4  # the clip engages
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, width).contiguous()
    ref = old + torch.randn(rows, width, generator=gen) * 0.2
    return logprobs, {
        "response_mask": mask,
        "old_log_probs": old,
        "advantages": advantages,
        "ref_log_prob": ref,
    }


@pytest.mark.parametrize("mode", verl_loss.AGGREGATIONS)
def test_aggregation_matches_verls_on_the_whole_batch(mode):
    values, batch = _batch()
    mask = batch["response_mask"]
    ours = verl_loss.aggregate(values, mask, mode, float(mask.sum()), float(len(mask)))
    theirs = core_algos.agg_loss(values, mask.bool(), mode)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (mode, ours, theirs)


@pytest.mark.parametrize("mode", verl_loss.AGGREGATIONS)
def test_ranks_losses_sum_to_the_reference_loss(mode):
    """verl's per-rank loss (global counts, times dp) averaged over two ranks is our one loss."""
    values, batch = _batch(rows=8)
    mask = batch["response_mask"].bool()
    tokens, rows = int(mask.sum()), len(mask)
    halves = [
        core_algos.agg_loss(
            values[i::2],
            mask[i::2],
            mode,
            dp_size=2,
            batch_num_tokens=tokens,
            global_batch_size=rows,
        )
        for i in range(2)
    ]
    ours = verl_loss.aggregate(values, mask.float(), mode, float(tokens), float(rows))
    assert torch.allclose(sum(halves) / 2, ours, rtol=1e-6, atol=1e-7)


def test_surrogate_matches_verls_vanilla_policy_loss_with_dual_clip():
    logprobs, batch = _batch()
    from omegaconf import OmegaConf  # verl brings it

    config = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "global_batch_info": {}}
    )
    theirs, metrics = core_algos.compute_policy_loss_vanilla(
        batch["old_log_probs"],
        logprobs,
        batch["advantages"],
        batch["response_mask"].bool(),
        "token-mean",
        config,
    )
    settings = verl_loss.LossSettings("token-mean", 0.1, 0.3, 3.0, 0.0, 0.0, "k1")
    mask = batch["response_mask"]
    ours = verl_loss.actor_loss(logprobs, None, batch, settings, float(mask.sum()), len(mask))
    assert metrics["actor/pg_clipfrac"] > 0  # the clip engaged
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", verl_loss.KL_TYPES)
def test_kl_estimators_match_verls(kind):
    logprobs, batch = _batch()
    theirs = core_algos.kl_penalty(logprobs, batch["ref_log_prob"], kind)
    assert torch.allclose(verl_loss.kl(logprobs, batch["ref_log_prob"], kind), theirs)


def test_the_resolved_defaults_are_read():
    settings = verl_loss.loss_settings(
        _config(clip_ratio=0.2, use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl")
    )
    assert (settings.clip_low, settings.clip_high, settings.kl_coef) == (0.2, 0.2, 0.01)
    optim = verl_loss.optimizer_settings(
        _config(optim__lr=1e-6, optim__betas=[0.8, 0.95], optim__weight_decay=0.1)
    )
    assert (optim.lr, optim.betas, optim.eps, optim.weight_decay) == (1e-6, (0.8, 0.95), 1e-8, 0.1)


@pytest.mark.parametrize(
    "actor, named",
    [
        ({"policy_loss__loss_mode": "gspo"}, "policy_loss.loss_mode=gspo"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_agg_mode=seq-mean-token-sum-norm"),
        ({"use_kl_loss": True, "kl_loss_type": "k3+"}, "kl_loss_type=k3+"),
        ({"optim__lr": 1e-6, "optim__lr_warmup_steps": 3}, "lr_warmup_steps=3"),
        ({"optim__lr": 1e-6, "optim__optimizer": "AdamW8bit"}, "optimizer="),
    ],
)
def test_what_the_reference_does_not_model_is_refused_by_name(actor, named):
    config = _config(**actor)
    with pytest.raises(Unmodelled) as refused:
        verl_loss.loss_settings(config)
        verl_loss.optimizer_settings(config)
    said = str(refused.value)
    assert named in said and "\n" not in said, said


def test_an_update_one_rounding_away_passes_and_a_wrong_lr_does_not():
    """i's closed form: an optimizer that rounds `p - lr * u` the other way (one fp32 spacing,
    0.12 x lr on a weight near 1.0 at verl's lr 1e-6) is no error; twice the step is."""
    from pytest_fsdp_turbo_engine.trainer.replay import largest_difference

    lr = 1e-6
    before = torch.tensor([1.0, 0.01, -0.5])
    want = before - lr * torch.tensor([1.0, -1.0, 1.0])
    other_rounding = torch.nextafter(want, torch.full_like(want, 2.0))
    assert largest_difference({"w": other_rounding}, {"w": want}) == (0.0, "")
    doubled = before - 2 * lr * torch.tensor([1.0, -1.0, 1.0])
    err, name = largest_difference({"w": doubled}, {"w": want})
    assert name == "w" and 0.8 < err / lr <= 1.0
    assert largest_difference({}, {"w": want})[0] == float("inf")


def _nested(**dotted) -> dict:
    """A resolved config from `root.key.key=value` pairs (dots as `__`)."""
    config: dict = {}
    for key, value in dotted.items():
        *parents, last = key.split("__")
        here = config
        for part in parents:
            here = here.setdefault(part, {})
        here[last] = value
    return config


def test_optimizer_settings_resolve_as_verls_own_config_does():
    """The deprecated keys win where verl copies them over the new ones (grad_clip over
    clip_grad), and the override dict reaches AdamW over lr, betas and weight decay, as verl's
    FSDPOptimizerConfig and build_optimizer resolve them."""
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    kwargs = {
        "lr": 1e-5,
        "betas": (0.8, 0.95),
        "weight_decay": 0.1,
        "clip_grad": 1.0,
        "grad_clip": 0.3,
        "override_optimizer_config": {"eps": 1e-6, "amsgrad": True, "weight_decay": 0.2},
    }
    ours = verl_loss.optimizer_settings(_config(**{f"optim__{k}": v for k, v in kwargs.items()}))
    with pytest.warns(DeprecationWarning):
        theirs = FSDPOptimizerConfig(**kwargs)
    group = build_optimizer([torch.nn.Parameter(torch.zeros(2))], theirs).param_groups[0]
    assert ours.grad_clip == theirs.clip_grad == 0.3
    assert (ours.lr, ours.betas, ours.eps) == (group["lr"], group["betas"], group["eps"])
    assert (ours.weight_decay, ours.amsgrad) == (group["weight_decay"], group["amsgrad"])


@pytest.mark.parametrize(
    "config, named",
    [
        (
            _nested(
                actor_rollout_ref__actor__optim__lr=1e-6,
                actor_rollout_ref__actor__optim__lr_scheduler_type="constant",
                actor_rollout_ref__actor__optim__warmup_style="cosine",
            ),
            "lr_scheduler_type=cosine",
        ),
        (
            _nested(
                actor_rollout_ref__actor__optim__lr=1e-6,
                actor_rollout_ref__actor__optim__override_optimizer_config={"nesterov": True},
            ),
            "override_optimizer_config: nesterov",
        ),
        (_nested(algorithm__rollout_correction__rollout_is="token"), "rollout_is=token"),
        (_nested(algorithm__rollout_correction__bypass_mode=True), "bypass_mode=true"),
        (_nested(distillation__enabled=True), "distillation.enabled=true"),
        (_nested(algorithm__adv_estimator="gae"), "adv_estimator=gae"),
        (_nested(critic__enable=True, algorithm__adv_estimator="grpo"), "critic.enable=true"),
    ],
)
def test_what_changes_the_step_beyond_the_loss_is_refused_by_name(config, named):
    with pytest.raises(Unmodelled) as refused:
        verl_loss.refuse_unmodelled_run(config)
        verl_loss.optimizer_settings(config)
    said = str(refused.value)
    assert named in said and "\n" not in said, said


def test_a_grpo_run_without_a_critic_is_modelled():
    verl_loss.refuse_unmodelled_run(
        _nested(algorithm__adv_estimator="grpo", critic__enable=None, distillation__enabled=False)
    )


def test_the_actors_layout_is_read_where_verls_engine_reads_it():
    """Ulysses from the engine config (or the actor's deprecated key where over 1), bf16 where
    no mixed precision is set, fp16 refused."""
    from pytest_fsdp_turbo_engine.trainer.replay import compute_dtype, sp_size

    engine = _nested(actor_rollout_ref__actor__fsdp_config__ulysses_sequence_parallel_size=2)
    assert sp_size(engine) == 2 and compute_dtype(engine) == torch.bfloat16
    legacy = _nested(
        actor_rollout_ref__actor__ulysses_sequence_parallel_size=4,
        actor_rollout_ref__actor__fsdp_config__ulysses_sequence_parallel_size=1,
    )
    assert sp_size(legacy) == 4
    turbo = _nested(
        actor_rollout_ref__actor__strategy="fsdp_turbo",
        actor_rollout_ref__actor__fsdp_config__turbo_config__distributed__ulysses_parallel_size=2,
        actor_rollout_ref__actor__fsdp_config__turbo_config__distributed__fsdp_plan__param_dtype="fp32",
    )
    assert sp_size(turbo) == 2 and compute_dtype(turbo) == torch.float32
    for name in ("fp16", 16, "float16"):
        fp16 = _nested(actor_rollout_ref__actor__fsdp_config__mixed_precision__param_dtype=name)
        with pytest.raises(Unmodelled, match="param_dtype=fp16"):
            compute_dtype(fp16)
    for name in (32, "32", "float32"):  # verl's FLOAT_LIST
        fp32 = _nested(actor_rollout_ref__actor__fsdp_config__mixed_precision__param_dtype=name)
        assert compute_dtype(fp32) == torch.float32


def test_the_reference_in_bf16_leaves_its_fp32_model_and_buffers_as_they_were(tiny_model):
    """The bf16 pass that measures the reference's own noise runs on a copy whose parameters
    alone are cast (FSDP's mixed precision keeps buffers such as the rotary frequencies): the
    fp32 gradients after it are bit-identical to those before it."""
    from pytest_fsdp_turbo_engine.trainer.replay import Reference

    path = tiny_model("tiny-qwen3")
    settings = verl_loss.loss_settings(_config())
    optim = verl_loss.optimizer_settings(_config(optim__lr=1e-6))
    ref = Reference(str(path), settings, optim)
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    _, batch = _batch(rows=2, width=5)
    ids = torch.arange(3, 11)
    rows = [
        {
            "ids": ids,
            "prompt": 3,
            "response": 5,
            "temperature": 1.0,
            **{k: v[i] for k, v in batch.items()},
        }
        for i in range(2)
    ]
    first, _ = ref.gradients(before, rows, torch.float32)
    buffers = {n: b.clone() for n, b in ref.model.named_buffers()}
    low, _ = ref.gradients(before, rows, torch.bfloat16)
    again, _ = ref.gradients(before, rows, torch.float32)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(torch.equal(b, buffers[n]) for n, b in ref.model.named_buffers())
    assert all(b.dtype == buffers[n].dtype for n, b in ref.in_dtype(torch.bfloat16).named_buffers())
    assert any(
        not torch.equal(first[n], low[n]) for n in first
    )  # the bf16 pass did compute in bf16


def test_continuity_is_exact_and_names_the_parameter_that_moved():
    from pytest_fsdp_turbo_engine.trainer.replay import continuity

    after = {"a": torch.ones(3), "b": torch.zeros(2)}
    assert continuity({k: v.clone() for k, v in after.items()}, None) == (None, "")
    assert continuity({k: v.clone() for k, v in after.items()}, after) == (0.0, "")
    moved = {"a": torch.ones(3), "b": torch.tensor([0.0, 1e-7])}
    err, name = continuity(moved, after)
    assert name == "b" and err == pytest.approx(1e-7)
    nan = {"a": torch.tensor([1.0, float("nan"), 1.0]), "b": torch.zeros(2)}
    assert continuity(nan, after)[1] == "a"


def test_the_reference_policys_dtype_is_verls_forward_only_default():
    """verl loads a forward-only model in bf16 where model_dtype is unset, and its YAML's fp32
    still computes in mixed precision's bf16 unless that is fp32 too."""
    from pytest_fsdp_turbo_engine.trainer.replay import reference_dtype

    ref = "actor_rollout_ref__ref__fsdp_config__"
    assert reference_dtype(_nested()) == torch.bfloat16
    assert reference_dtype(_nested(**{f"{ref}model_dtype": "fp32"})) == torch.bfloat16
    fp32 = {f"{ref}model_dtype": "fp32", f"{ref}mixed_precision__param_dtype": "fp32"}
    assert reference_dtype(_nested(**fp32)) == torch.float32
