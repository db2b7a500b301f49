"""verl's documented actor loss, written again from its documentation for the harness's reference
(never imported from verl: a replay that runs verl's own loss shares its bugs). What the resolved
config asks for and this module does not model is refused by name (`Unmodelled`), never
approximated.

The loss of one optimizer step over the union of the data-parallel ranks' mini-batches, as verl's
FSDP engines mean it: the vanilla clipped surrogate with dual clip, aggregated over the global
batch (`loss_agg_mode`), minus the entropy bonus, plus the KL loss against the reference policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_fsdp_turbo_contract.trainer_spec import ACTOR, clip_key, config_value

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# what verl's `override_optimizer_config` may hand torch's AdamW that the reference applies too;
# foreach and fused change only how each `p - lr * u` rounds (within one spacing, which i allows)
ADAMW_OVERRIDES = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused")


class Unmodelled(Exception):
    """The resolved config asks for something the reference does not model (one line)."""


@dataclass(frozen=True)
class LossSettings:
    loss_agg_mode: str
    clip_low: float
    clip_high: float
    clip_c: float
    entropy_coeff: float
    kl_coef: float  # 0: no KL loss
    kl_type: str


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float
    amsgrad: bool = False
    maximize: bool = False


_get = config_value


def refuse_unmodelled_run(config: dict) -> None:
    """What changes the actor's step beyond its loss and optimizer, refused by name: importance
    weights or a bypassed old policy (rollout correction), a distillation loss, and a critic (its
    engine trains in the same processes, through the same seams the capture reads)."""
    correction = "algorithm.rollout_correction"
    if (weights := _get(config, f"{correction}.rollout_is")) is not None:
        raise Unmodelled(f"{correction}.rollout_is={weights}: importance weights are not modelled")
    if _get(config, f"{correction}.bypass_mode", False):
        raise Unmodelled(
            f"{correction}.bypass_mode=true: the rollout's log-probs as the old "
            "policy are not modelled"
        )
    if _get(config, "distillation.enabled", False):
        raise Unmodelled("distillation.enabled=true: the distillation loss is not modelled")
    critic = _get(config, "critic.enable")
    gae = _get(config, "algorithm.adv_estimator") == "gae"
    if critic or (critic is None and gae):
        said = "critic.enable=true" if critic else "algorithm.adv_estimator=gae (a critic)"
        raise Unmodelled(
            f"{said}: the capture reads one engine's steps, and a critic's engine "
            "steps beside the actor's"
        )


def loss_settings(config: dict) -> LossSettings:
    """The actor loss the resolved config declares, or the first thing the reference refuses."""
    mode = _get(config, f"{ACTOR}.policy_loss.loss_mode", "vanilla")
    if mode != "vanilla":
        raise Unmodelled(f"{ACTOR}.policy_loss.loss_mode={mode}: only 'vanilla' is modelled")
    agg = str(_get(config, f"{ACTOR}.loss_agg_mode", "token-mean"))
    if agg == "seq-mean-token-sum-norm" and _get(config, f"{ACTOR}.loss_scale_factor") is None:
        raise Unmodelled(
            f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor: verl "
            "divides by each micro-batch's padded width, which only its own split decides"
        )
    if agg not in AGGREGATIONS:
        raise Unmodelled(f"{ACTOR}.loss_agg_mode={agg}: modelled are {', '.join(AGGREGATIONS)}")
    ratio = float(_get(config, f"{ACTOR}.clip_ratio", 0.2))
    low, high = _get(config, f"{ACTOR}.clip_ratio_low"), _get(config, f"{ACTOR}.clip_ratio_high")
    use_kl = bool(_get(config, f"{ACTOR}.use_kl_loss", False))
    kl_type = str(_get(config, f"{ACTOR}.kl_loss_type", "low_var_kl"))
    if use_kl and kl_type not in KL_TYPES:
        raise Unmodelled(
            f"{ACTOR}.kl_loss_type={kl_type}: modelled are {', '.join(KL_TYPES)} (no "
            "straight-through '+' variant, no 'full')"
        )
    return LossSettings(
        loss_agg_mode=agg,
        clip_low=ratio if low is None else float(low),
        clip_high=ratio if high is None else float(high),
        clip_c=float(_get(config, f"{ACTOR}.clip_ratio_c", 3.0)),
        entropy_coeff=float(_get(config, f"{ACTOR}.entropy_coeff", 0.0) or 0.0),
        kl_coef=float(_get(config, f"{ACTOR}.kl_loss_coef", 0.0)) if use_kl else 0.0,
        kl_type=kl_type,
    )


def optimizer_settings(config: dict) -> OptimizerSettings:
    """torch's AdamW at a constant learning rate, as the resolved config declares it."""
    optim = f"{ACTOR}.optim"
    name, impl = (
        _get(config, f"{optim}.optimizer", "AdamW"),
        _get(config, f"{optim}.optimizer_impl"),
    )
    if name != "AdamW" or impl not in (None, "torch.optim"):
        raise Unmodelled(f"{optim}.optimizer={impl}.{name}: only torch.optim.AdamW is modelled")
    # verl copies the deprecated warmup_style over lr_scheduler_type where it is set
    schedule = _get(config, f"{optim}.warmup_style") or _get(config, f"{optim}.lr_scheduler_type")
    warmup = _get(config, f"{optim}.lr_warmup_steps", -1) or -1
    ratio = _get(config, f"{optim}.lr_warmup_steps_ratio", 0.0) or 0.0
    if schedule not in (None, "constant") or warmup > 0 or ratio > 0:
        raise Unmodelled(
            f"{optim}: lr_scheduler_type={schedule}, lr_warmup_steps={warmup}, "
            f"lr_warmup_steps_ratio={ratio}: only a constant learning rate without warmup is "
            "modelled"
        )
    # verl hands AdamW lr, weight_decay and betas, then its override dict over them
    args = {
        "lr": _get(config, f"{optim}.lr"),
        "weight_decay": _get(config, f"{optim}.weight_decay", 0.01),
        "betas": _get(config, f"{optim}.betas", [0.9, 0.999]),
    }
    overrides = _get(config, f"{optim}.override_optimizer_config") or {}
    if unknown := sorted(set(overrides) - set(ADAMW_OVERRIDES)):
        raise Unmodelled(
            f"{optim}.override_optimizer_config: {', '.join(unknown)}: the reference's AdamW "
            f"applies only {', '.join(ADAMW_OVERRIDES)}"
        )
    args.update(overrides)
    betas = args["betas"]
    return OptimizerSettings(
        lr=float(args["lr"]),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(args.get("eps", 1e-8)),  # torch's default: verl's config has no eps of its own
        weight_decay=float(args["weight_decay"]),
        grad_clip=float(_get(config, clip_key(config), 1.0)),
        amsgrad=bool(args.get("amsgrad", False)),
        maximize=bool(args.get("maximize", False)),
    )


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, tokens: float, rows: float
) -> torch.Tensor:
    """One loss over the global batch: `tokens` and `rows` are the whole step's (every data-parallel
    rank's), so the sum over ranks of verl's per-rank losses, averaged by FSDP, is this."""
    if mode == "token-mean":
        return (values * mask).sum() / tokens
    if mode == "token-sum":
        return (values * mask).sum()
    per_row = (values * mask).sum(-1)
    counts = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / (counts + 1e-8)
    return (per_row * (counts > 0)).sum() / rows


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """The KL estimators of Schulman's note (k1, |k1|, k2, k3), as verl names them."""
    diff = logprobs - ref_logprobs
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    back = (-diff).clamp(-20, 20)
    return (back.exp() - back - 1).clamp(-10, 10)


def surrogate(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, s: LossSettings
) -> torch.Tensor:
    """Per token: the clipped surrogate, and for negative advantages its dual clip at clip_c."""
    ratio = (logprobs - old).clamp(-20, 20).exp()
    plain = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
    pessimistic = torch.maximum(plain, clipped)
    dual = torch.minimum(pessimistic, -advantages * s.clip_c)
    return torch.where(advantages < 0, dual, pessimistic)


def actor_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: dict[str, torch.Tensor],
    s: LossSettings,
    tokens: float,
    rows: float,
) -> torch.Tensor:
    """The step's loss on padded [rows, response] tensors of the global batch."""
    mask = batch["response_mask"]
    loss = aggregate(
        surrogate(logprobs, batch["old_log_probs"], batch["advantages"], s),
        mask,
        s.loss_agg_mode,
        tokens,
        rows,
    )
    if s.entropy_coeff and entropy is not None:
        loss = loss - s.entropy_coeff * aggregate(entropy, mask, s.loss_agg_mode, tokens, rows)
    if s.kl_coef:
        k = kl(logprobs, batch["ref_log_prob"], s.kl_type)
        loss = loss + s.kl_coef * aggregate(k, mask, s.loss_agg_mode, tokens, rows)
    return loss
