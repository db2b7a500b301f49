"""One PPO step inside one rank, a module per job. Each phase is a function that takes what it
needs and returns the typed record of what it measured (pytest_fsdp_turbo_contract/records.py);
the measuring itself is in measurements.py and fsdp_probe.py.

- phases.py: where the rank is (announced, recorded for live progress, timed; faults injected)
- rank.py: what every phase shares, built once (device, engine, tokenizer, reference, rollout)
- batch.py: prompts, rollout, reward, advantages, log-probabilities (or a twin's replayed batch)
- train.py: the micro-batch loop under the engine's gradient-sync policy
- reference_run.py: the single-process reference's gradients and steps
- optimizer_step.py: the engine's optimizer step against the harness's norm, clip and AdamW
- post_step.py: replicas, the weight hand-off, the post-step log-probabilities, the twin's
- run.py: `run_ppo_step`, the phases in order; it keeps the records as they come, so a failure
  keeps every record filled before it

What the phases measure with, and hold the engine to:
- measurements.py, fsdp_probe.py: the harness's probes (norms, collectives counted, closed forms)
- reference.py: the single-process reference the reference phase steps
PPO's maths, the batch and the harness's collectives are in pytest_fsdp_turbo_engine/core/, which
engines and rollouts share.

rollout -> reward -> advantages -> logprobs -> micro-batches under the case's gradient-sync policy
-> (reference gradients) -> optimizer step -> (reference step) -> post-step checks -> metrics.

A twin run (`ppo.replay` set) skips rollout and reward and trains on the batch the main run saved.
Every measurement a check depends on is taken here, never inside an engine method.
"""
