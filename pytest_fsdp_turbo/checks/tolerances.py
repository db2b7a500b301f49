"""How close each check holds a reading, by compute dtype, and why; how far inside them healthy
runs land: benchmarks/check_margins.py."""

from __future__ import annotations

# Tolerances by compute dtype; measured margins: benchmarks/check_margins.py (README). fp32 gradient
# parity per parameter allows for reduction-order differences in long reductions (gated delta-net
# decay parameters: 5.6e-5). Under bf16 compute, parameters whose reference gradient is tiny flip
# sign against an fp32 reference, so bf16 is held to whole-gradient relative L2 errors instead.
# Per parameter, relative to its largest reference entry, or to 1e-3 of the largest of any
# parameter where its own is smaller (pytest_fsdp_turbo_engine/step/reference.py, CANCELLED_SHARE).
GRAD_PARITY_TOL = {"fp32": 1e-4}
GRAD_PARITY_L2_TOL = {"fp32": 1e-5, "bf16": 5e-2}  # all gradients: ||g - ref|| / ||ref||
# Deferred vs every-micro-batch sum the same gradients in a different order. Measured on Qwen3.5's
# gated delta-net A_log: 2.2e-7 with transformers 5.24, 1.2e-6 with 5.10 (verl's pin); a sync bug
# is O(1).
POLICY_AGREEMENT_TOL = {"fp32": 1e-5, "bf16": 1e-2}
# A verl trainer run's micro-batch pair: one parameter's gradient over k micro-batches against one
# pass of the same mini-batch, relative L2 (pytest_fsdp_turbo_engine/trainer/micro_batch_pair.py).
# Measured on verl's engines through main_ppo, 2 micro-batches a rank, worst parameter, 2026-12-07:
# bf16 2.4e-3 (FSDP-Turbo, Ulysses SP 2) to 9.0e-3 (FSDP2, the deferred case's second step, when
# it ran in bf16) over three cases and five steps, the embedding and the norms' weights the worst;
# fp32 6.5e-7 to 9.4e-7 (FSDP2, mixed precision fp32, PPO's clip engaged on the second step). About
# 3x and 11x the worst; gradients zeroed as each micro-batch begins read 0.92 in bf16.
MICRO_BATCH_PAIR_TOL = {"fp32": 1e-5, "bf16": 3e-2}
ON_POLICY_KL_TOL = {"fp32": 1e-5, "bf16": 1e-2}
# The same per token, fp32 only: a micro-batch's forward against the whole batch's, float rounding
# (measured: benchmarks/check_margins.py); bf16 autocast rounds each token's logprob too coarsely.
ON_POLICY_LOG_RATIO_TOL = {"fp32": 1e-4}
WEIGHT_SYNC_TOL = {"fp32": 1e-4, "bf16": 1e-1}
NORM_AGREEMENT_REL = 1e-6  # the same number on every rank
# The engine's norm against the harness's own sum over the same sharded gradients (fp32 either way).
GRAD_NORM_TRUE_REL = {"fp32": 1e-5, "bf16": 1e-3}
# The engine's norm against the reference gradients' norm (verl's bf16 anchor: rtol 3e-2).
GRAD_NORM_REFERENCE_REL = {"fp32": 1e-4, "bf16": 3e-2}
# Post-step parameters against the reference step, in units of the learning rate (Adam's first
# step moves every entry by about lr, so 1.0 would be "one entry went the other way"), and the
# whole update's relative L2 error (a doubled step is 1.0, a rank that did not step about 0.7).
STEP_TOL_LR = {"fp32": 5e-2}
# AdamW in closed form against the engine's step, in units of lr, beyond one spacing of each
# parameter's dtype at its value (sync/adamw_step_max_err_lr): two correct roundings of one step
# may sit a spacing apart, 1.19e-3 lr for a weight near 1 at lr 1e-4 (verl's FSDP2 engine, AMD
# EPYC); what remains is the step's arithmetic: 2.2e-7 to 2.8e-7 lr on that healthy run
ADAMW_STEP_TOL_LR = {"fp32": 1e-3, "bf16": 1e-3}
STEP_L2_TOL = {"fp32": 1e-3, "bf16": 0.5}
# Replay twin (same batch, reference layout): loss (atol, rtol), grad norm rtol, post-step logprobs.
TWIN_LOSS_TOL = {"fp32": (1e-6, 1e-5), "bf16": (1e-2, 1e-2)}
TWIN_GRAD_NORM_REL = {"fp32": 1e-5, "bf16": 3e-2}
TWIN_LOGPROB_TOL = {"fp32": 1e-5, "bf16": 5e-2}
# Each rank's old log-probs against the twin's forward of the same rows, before either trained.
# Healthy fp32: 0 to 9.5e-7, one ulp of a log-prob near -8 (ours, verl's FSDP2, SP on the
# stand-in); one rank's rotary embedding in bf16: 6.7e-6. bf16: ours 1.9e-3, verl's FSDP-Turbo
# engine (bf16 log-probs) 3.1e-2, so a per-rank precision bug of that size is invisible in bf16.
TWIN_OLD_LOGPROB_TOL = {"fp32": 2.5e-6, "bf16": 5e-2}
# per parameter, |difference| of the gradient's norm and projection relative to the twin's norm;
# measured on healthy runs: fp32 1.5e-6, bf16 3.1e-2 (a 4-element dt_bias); the bf16 mutant that
# sends gradients to the wrong SP rank: 10.4
TWIN_SKETCH_TOL = {"fp32": 1e-4, "bf16": 1e-1}
# ... relative to at least this share of the largest gradient norm of any parameter: a gradient
# smaller than that is what is left of cancelling terms, all rounding (measured: a gated
# delta-net A_log at 1e-5 of the largest norm, 0.24 to 0.81 of itself apart under bf16)
SKETCH_CANCELLED_SHARE = 1e-3
# bf16: from the second update on, tokens at PPO's clip boundary land on either side of it in the
# run and in its twin by rounding alone, and a flipped token's gradient is all or nothing: healthy
# runs of ours measured up to 0.61 of a parameter's norm apart (22% of tokens clipped). The
# sketches are compared on the first, on-policy update only; l judges every update's loss.
SKETCH_FIRST_UPDATE_ONLY = ("bf16",)
LATER_UPDATE = " (update "  # how a later update's entries are named (records.EACH)

CLIP_TOL = {"fp32": 1e-5, "bf16": 1e-4}  # relative to the largest clipped gradient entry

# The engine's loss gradient on each log-probability against autograd over the harness's loss on
# the same values. fp32: the same formula, measured 0.0 on ours and verl's engines. bf16: an
# engine whose log-probabilities are bf16 (verl's FSDP-Turbo engine) gets its gradient in bf16
# arithmetic, measured 4.5e-3; ours keep fp32 log-probabilities (0.0).
LOSS_GRAD_TOL = {"fp32": 1e-6, "bf16": 2e-2}
# A trainer run that computes in bf16 is held, on b, c and i, to this many times the distance the
# reference itself moves from its fp32 result when it computes in bf16 from the same parameters on
# the same batch (measured in that run). Both are bf16 computations of the same step with different
# rounding (FSDP's cast parameters, verl's micro-batches), so a healthy engine sits near 1x. An
# engine case in bf16 holds each parameter's gradient to it too (c, checks/gradients.py,
# worst_beyond_rounding): its distance from the reference's bf16 gradient, against that gradient's
# distance from fp32 (or the run's median parameter's). Measured in the NPU target's mode (tiny
# Qwen3.5, SP 2, ours and verl's FSDP-Turbo engines, seeds 1 to 5, benchmarks/bf16_parameters.py,
# 2026-12-07): healthy at most 1.95x (0.65 of the tolerance); a small parameter's gradient zeroed
# 4.7x to 87x, halved 2.3x to 43x (the one pass: a dt_bias that rounds 0.21 of its norm away).
REFERENCE_NOISE_FACTOR = 3.0
