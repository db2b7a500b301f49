"""PPO / GRPO math against values computed by hand."""

import math

import pytest

torch = pytest.importorskip("torch")

from pytest_fsdp_turbo_engine.core import ppo  # noqa: E402


def test_grpo_normalises_within_each_group():
    scores = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    adv = ppo.grpo_advantages(scores, group_size=3, eps=0.0)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_grpo_identical_rewards_give_zero_advantage():
    assert torch.equal(ppo.grpo_advantages(torch.ones(4), 4), torch.zeros(4))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    adv, ret = ppo.gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.25, 0.5, 1.0]]))
    assert torch.allclose(ret, adv)
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = ppo.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.0)
    # lam = 0: one-step TD errors r_t + V_{t+1} - V_t (V after the last token is 0)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.0, 0.5]]))
    assert torch.allclose(ret, torch.tensor([[0.5, 0.5, 1.0]]))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0]])
    adv = torch.tensor([[1.0, -2.0]])
    loss, clipfrac, kl = ppo.policy_loss(logp, logp.clone(), adv, torch.ones(1, 2), global_tokens=2)
    assert loss.item() == pytest.approx(0.5)
    assert clipfrac.item() == 0.0 and kl.item() == 0.0


def test_policy_loss_clips_positive_advantage():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[1.5]]))
    loss, clipfrac, kl = ppo.policy_loss(
        new, old, torch.ones(1, 1), torch.ones(1, 1), 1, clip_ratio=0.2
    )
    assert loss.item() == pytest.approx(-1.2)
    assert clipfrac.item() == 1.0
    assert kl.item() == pytest.approx(-math.log(1.5))


def test_dual_clip_bounds_negative_advantage():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[5.0]]))
    loss, _, _ = ppo.policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1), 1, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_token_mean_over_global_batch_is_split_invariant():
    torch.manual_seed(0)  # the same draw wherever xdist schedules it
    logp = torch.randn(4, 5)
    old = logp + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    tokens = float(mask.sum())
    whole, _, _ = ppo.policy_loss(logp, old, adv, mask, tokens)
    parts = sum(
        ppo.policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], tokens)[0]
        for i in range(4)
    )
    # float32 sums of terms near 0.1 that can cancel: an absolute bound, not a relative one
    assert whole.item() == pytest.approx(parts.item(), rel=1e-6, abs=1e-6)


def test_low_var_kl_by_hand():
    kl = ppo.low_var_kl(torch.tensor([0.0]), torch.tensor([math.log(2.0)]))
    assert kl.item() == pytest.approx(2.0 - math.log(2.0) - 1.0)
    assert ppo.low_var_kl(torch.tensor([0.3]), torch.tensor([0.3])).item() == 0.0


def test_entropy_of_uniform_logits():
    assert ppo.entropy_from_logits(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)


def test_response_logprobs_gathers_taken_tokens():
    logits = torch.log(torch.tensor([[[0.25, 0.75]]]))
    assert ppo.response_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(
        math.log(0.75)
    )


@pytest.fixture
def _torch_env_side_effects():
    """torch sets TORCHINDUCTOR_CACHE_DIR on first use in-process; keep the env guard honest."""
    from pytest_fsdp_turbo.environ import restored_environ

    with restored_environ():
        yield


@pytest.mark.usefixtures("_torch_env_side_effects")
def test_adamw_in_closed_form_is_torchs_adamw_over_three_steps():
    """The harness's own AdamW (check i) against torch's, with betas, eps and weight decay that
    are not the defaults and a parameter that misses a gradient on one step."""
    from dataclasses import replace

    from pytest_fsdp_turbo_contract.spec import EngineSpec
    from pytest_fsdp_turbo_engine.engines.fsdp2 import adamw
    from pytest_fsdp_turbo_engine.step.measurements import adamw_closed_form

    cfg = replace(
        EngineSpec(world_size=1, fsdp_size=1),
        lr=1e-2,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_eps=1e-6,
        weight_decay=0.1,
    )
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    optimizer = adamw(params, cfg)
    moments = None
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        if step == 1:
            grads[1] = None  # torch skips it: no decay, no moment update
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        expected, moments = adamw_closed_form(before, grads, cfg, moments)
        for p, want in zip(params, expected):
            assert torch.allclose(p.detach(), want, atol=1e-6, rtol=0), step
    assert moments.steps == [3, 2]


@pytest.mark.usefixtures("_torch_env_side_effects")
def test_the_probe_compares_the_loss_gradient_an_engine_delivers_with_the_closed_form():
    """Check l's measurement: the gradient a backward delivers to the reported log-probabilities,
    against autograd over the harness's loss. Off-policy (old != current), a KL term counted
    twice moves it; a detached tensor never receives one (infinite)."""
    from pytest_fsdp_turbo_contract.spec import PPOSpec
    from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch, ppo_loss
    from pytest_fsdp_turbo_engine.step.fsdp_probe import CollectiveCounter
    from pytest_fsdp_turbo_engine.step.measurements import MicroBatchProbe

    torch.manual_seed(0)
    cfg = PPOSpec(kl_coef=0.1)
    current = torch.randn(2, 5) - 2
    mb = TrainBatch(
        input_ids=torch.zeros(2, 8, dtype=torch.long),
        prompt_len=3,
        mask=torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2]),
        advantages=torch.randn(2, 5),
        old_logprobs=current + 0.3 * torch.randn(2, 5),
        ref_logprobs=current + 0.3 * torch.randn(2, 5),
    )
    module = torch.nn.Linear(1, 1)

    def measured(extra_kl: float, detached: bool = False) -> float:
        with CollectiveCounter() as counter:
            probe = MicroBatchProbe(module, 8.0, cfg, counter, loss_scale=2.0)
            logprobs = current.clone().requires_grad_()
            reported = logprobs.detach() if detached else logprobs
            probe.loss_computed(reported, None, mb)
            loss, _ = ppo_loss(logprobs, None, mb, 8.0, cfg)
            (2.0 * (loss + extra_kl * kl(logprobs))).backward()
        return probe.loss_grad_max_rel_err

    def kl(logprobs):
        return ppo.token_sum(ppo.low_var_kl(logprobs, mb.ref_logprobs), mb.mask) / 8.0

    assert measured(0.0) == 0.0
    assert measured(cfg.kl_coef) > 1e-3
    assert measured(0.0, detached=True) == math.inf
