"""Trainer cases (verl's own main_ppo), without running verl: the case schema and its one-line
errors, what verl's resolved config declares, the observer's readings read back as a run, the
trainer checks on hand-made readings, and the cause first when the trainer fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import textwrap
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.cases.trainer_case import TrainerCase, overrides_of_script
from pytest_fsdp_turbo.kinds.registry import load_book
from pytest_fsdp_turbo.trainer.run import first_cause, read_run
from pytest_fsdp_turbo.trainer.verl_config import SYNC_FLAG, declared
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_spec import TrainerSpec, updates_per_step
from pytest_fsdp_turbo_contract.vocab import DeviceKind, SyncPolicy

REPO = Path(__file__).resolve().parents[1]
BASE = """
[[trainer_case]]
id = "t"
model = "tiny-qwen3-chat"
overrides = ["trainer.n_gpus_per_node=2", "data.train_files={data}/train.parquet"]
"""


def book(tmp_path: Path, text: str):
    path = tmp_path / "cases.toml"
    path.write_text(textwrap.dedent(text))
    return load_book(path)


@pytest.mark.parametrize(
    ("extra", "field", "expected"),
    [
        ('color = "red"', "color", "a known field"),
        ("world_size = 4", "world_size", "trainer.n_gpus_per_node x trainer.nnodes"),
        ('devices = ["tpu"]', "devices", "one of cpu, cuda, npu"),
        ("timeout = -1", "timeout", "a number of seconds > 0"),
        ("steps = 0", "steps", "a positive integer; got 0"),
        ('steps = "2"', "steps", "an integer"),
        ('extends = "nope"', "extends", "the id of a trainer case above this one"),
        # the fifth set of hostile inputs: each refused in one line, nothing dropped or escaped
        ('extends = ["a", "b"]', "extends", "the id of one trainer case above this one"),
        ('devices = ["cpu", "cpu"]', "devices", "each member once"),
        ('env = { "A=B" = "1" }', "env", "a table of variable = string"),
        ('env = { PYTHONPATH = "/elsewhere" }', "env", "no variable the harness sets"),
        ('env = { PYTEST_FSDP_TURBO_TRAINER_RUN = "/tmp" }', "env", "no variable the harness"),
        ('external_modules = ["../evil"]', "external_modules", "importable module names"),
        ('model = "../../etc"', "model", "a tiny spec (tiny-...) or a folder inside the models"),
        ('script = "/etc/passwd"', "script", "a script inside the case file's folder"),
        ('script = "../outside.sh"', "script", "a script inside the case file's folder"),
    ],
)
def test_a_bad_trainer_case_is_one_line_naming_file_case_and_field(
    tmp_path, extra, field, expected
):
    base = BASE.replace('model = "tiny-qwen3-chat"\n', "") if extra.startswith("model") else BASE
    with pytest.raises(ConfigError) as err:
        book(tmp_path, base + extra + "\n")
    message = str(err.value)
    assert "\n" not in message
    assert f"trainer case 't': field {field!r}: expected {expected}" in message
    assert str(tmp_path / "cases.toml") in message


def test_a_trainer_cases_steps_are_verls_training_steps_set_after_its_own_overrides(tmp_path):
    """`steps` is trainer.total_training_steps, set by the harness after the case's overrides (a
    case's own value would be replaced, so the field is the one place to say it)."""
    from pytest_fsdp_turbo_engine.trainer.main import harness_overrides

    (case,) = book(tmp_path, BASE + "steps = 3\n").trainer_cases
    assert case.steps == 3
    spec = TrainerSpec(
        case_id="t",
        device_kind=DeviceKind.CPU,
        world_size=2,
        model_path="m",
        overrides=case.overrides,
        total_training_steps=case.steps,
    )
    said = harness_overrides(spec, TrainerFolder(tmp_path / "run"))
    assert said[0] == "trainer.total_training_steps=3"
    (default,) = book(tmp_path, BASE).trainer_cases
    assert default.steps == 1


def test_a_tiny_trainer_case_has_its_reference_unless_it_says_no_and_a_real_one_asks(tmp_path):
    """The reference and the micro-batch pair alike: on for tiny models, asked for by a real one."""
    loaded = book(
        tmp_path,
        BASE
        + """
[[trainer_case]]
id = "t-off"
extends = "t"
reference = false
micro_batch_pair = false

[[trainer_case]]
id = "real"
model = "Qwen3.5-2B"
overrides = ["trainer.n_gpus_per_node=2"]

[[trainer_case]]
id = "real-on"
extends = "real"
reference = true
micro_batch_pair = true
""",
    )
    have = {case.id: case.with_reference for case in loaded.trainer_cases}
    assert have == {"t": True, "t-off": False, "real": False, "real-on": True}
    pairs = {case.id: case.with_micro_batch_pair for case in loaded.trainer_cases}
    assert pairs == have
    with pytest.raises(ConfigError, match="trainer case 't': field 'reference': expected"):
        book(tmp_path, BASE + 'reference = "yes"\n')
    with pytest.raises(ConfigError, match="trainer case 't': field 'micro_batch_pair': expected"):
        book(tmp_path, BASE + "micro_batch_pair = 2\n")


@pytest.mark.parametrize("override", ["data.x={modle}", "not an override", "=value"])
def test_overrides_are_hydra_overrides_with_known_placeholders(tmp_path, override):
    text = BASE.replace('"data.train_files={data}/train.parquet"', json.dumps(override))
    with pytest.raises(ConfigError, match="field 'overrides'"):
        book(tmp_path, text)


def test_nodes_alone_count_verls_eight_devices_a_node_against_the_world_size(tmp_path):
    nodes_only = BASE.replace('"trainer.n_gpus_per_node=2"', '"trainer.nnodes=5"')
    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node x trainer.nnodes .*\(40\)"):
        book(tmp_path, nodes_only)
    assert book(tmp_path, nodes_only + "world_size = 40\n").get_trainer("t").world_size == 40


def test_extends_puts_the_base_overrides_first_and_ids_are_unique_across_kinds(tmp_path):
    loaded = book(
        tmp_path,
        BASE
        + """
[[trainer_case]]
id = "t2"
extends = "t"
overrides = ["actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=True"]
""",
    )
    second = loaded.get_trainer("t2")
    assert second.overrides[:2] == loaded.get_trainer("t").overrides
    assert second.model == "tiny-qwen3-chat"
    assert second.override(SYNC_FLAG) == "True"
    clash = BASE + '\n[[case]]\nid = "t"\nmodel = "tiny-qwen3"\n'
    with pytest.raises(ConfigError, match="an id no \\[\\[case\\]\\] uses"):
        book(tmp_path, clash)


def test_a_scripts_main_ppo_line_gives_its_overrides(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "#!/bin/bash\nset -x\nexport HCCL_CONNECT_TIMEOUT=1500\n"
        "python3 -m verl.trainer.main_ppo \\\n"
        "    algorithm.adv_estimator=grpo \\\n"
        "    actor_rollout_ref.model.path=$MODEL_PATH \\\n"
        "    trainer.n_gpus_per_node=2 $@ | tee log\n"
    )
    assert overrides_of_script(script) == (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.path=$MODEL_PATH",
        "trainer.n_gpus_per_node=2",
    )
    case = book(
        tmp_path, BASE.replace("overrides = [", 'script = "run.sh"\noverrides = [')
    ).get_trainer("t")
    assert case.overrides[0] == "algorithm.adv_estimator=grpo"


def test_the_developer_pages_minimal_cpu_case_reads_as_written(tmp_path):
    """docs/verl-developers.md's case, with a script at the path it names: the script's overrides
    first, the case's after, and the fields the page explains as it explains them."""
    page = (REPO / "docs" / "verl-developers.md").read_text()
    toml = page.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "my_grpo.sh").write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo trainer.total_epochs=1 $@\n"
    )
    case = book(tmp_path, toml).get_trainer("my-grpo-cpu")
    assert case.overrides[:2] == ("algorithm.adv_estimator=grpo", "trainer.total_epochs=1")
    assert case.override("actor_rollout_ref.rollout.dtype") == "float32"
    assert (case.world_size, case.engine_class) == (2, "my_fork.engines.MyEngine")
    assert case.external_modules == ("my_fork.engines",) and case.with_reference


def verl_config(flag: bool, strategy: str = "fsdp2", sp: int = 1) -> dict:
    return {
        "actor_rollout_ref": {
            "actor": {
                "strategy": strategy,
                "ppo_mini_batch_size": 2,
                "ppo_micro_batch_size_per_gpu": 1,
                "ulysses_sequence_parallel_size": sp,
                "optim": {"clip_grad": 1.0},
                "fsdp_config": {
                    "use_no_sync_for_gradient_accumulation": flag,
                    "model_dtype": "fp32",
                    "turbo_config": {"distributed": {"ulysses_parallel_size": 2}},
                },
            },
            "rollout": {
                "n": 2,
                "name": "vllm",
                "tensor_model_parallel_size": 1,
                "dtype": "float32",
            },
        }
    }


def test_the_sync_policy_is_verls_flag_as_resolved():
    assert declared(verl_config(False), 2).gradient_sync == SyncPolicy.EVERY_MICRO_BATCH
    deferred = declared(verl_config(True), 2)
    assert deferred.gradient_sync == SyncPolicy.DEFERRED
    assert (deferred.micro_batches, deferred.rollout_replicas) == (2, 2)
    turbo = declared(verl_config(True, "fsdp_turbo"), 4)  # the library's Ulysses group
    assert (turbo.sp_size, turbo.micro_batches) == (2, 2)


def test_a_trainer_declares_the_dtype_verl_computes_in_beside_its_parameters_dtype():
    """verl's FSDP engines compute in bf16 unless a mixed precision says otherwise (its
    transformer_impl), and FSDP-Turbo in its plan's param_dtype; the parameters stay model_dtype."""
    plain = declared(verl_config(False), 2)
    assert (plain.model_dtype, plain.compute_dtype) == ("fp32", "bf16")
    config = verl_config(False)
    fsdp = config["actor_rollout_ref"]["actor"]["fsdp_config"]
    fsdp["mixed_precision"] = {"param_dtype": "fp32"}
    assert declared(config, 2).compute_dtype == "fp32"
    turbo = verl_config(False, "fsdp_turbo")
    plan = turbo["actor_rollout_ref"]["actor"]["fsdp_config"]["turbo_config"]["distributed"]
    plan["fsdp_plan"] = {"param_dtype": "fp32"}
    assert declared(turbo, 4).compute_dtype == "fp32"
    assert declared(verl_config(False, "fsdp_turbo"), 4).compute_dtype == "bf16"


needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None or importlib.util.find_spec("hydra") is None,
    reason="composing verl's trainer config needs verl (pip install 'pytest-fsdp-turbo[verl]')",
)


@needs_verl
def test_config_shows_the_seed_npu_case_sync_policy_as_verls_yaml_gives_it(capsys):
    from pytest_fsdp_turbo.cli import main

    assert main(["config", "qwen3_5-2b-verl-trainer-fsdp_turbo-fsdp8-sp2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].strip() == f"gradient_sync: every_micro_batch ({SYNC_FLAG} = false)"
    assert "strategy: fsdp_turbo, world size 16, Ulysses SP 2" in out[2]
    # the seed's script reads $HOME and exports HCCL's timeout: each shown as the run gets it
    out = "\n".join(out)
    assert (
        f"data.train_files=$HOME/data/geo3k/train.parquet   ($HOME = {os.environ['HOME']})" in out
    )
    assert "env (the case's; a script's export lines are not run: they belong here):" in out
    assert "  engine class: not declared: whatever verl's EngineRegistry holds" in out
    assert "  HCCL_CONNECT_TIMEOUT=1500" in out
    assert main(["config", "tiny-qwen3-verl-trainer-fsdp2-deferred"]) == 0
    out = capsys.readouterr().out
    assert f"gradient_sync: deferred ({SYNC_FLAG} = true)" in out
    # the base case's experiment name, replaced by the deferred case's own
    assert (
        "trainer.experiment_name=tiny-qwen3-verl-trainer   (replaced by a later override of " in out
    )


# --- a trainer run read back from the observer's files, and judged -------------------------------


def observed_run(
    tmp_path: Path,
    *,
    flag: bool = False,
    calls=((5, 5), (5, 5)),
    retained=(0, 0),
    reported=(2.0, 2.0),
    shard_sq=(2.0, 2.0),
    verl_norm: float = 2.0,
    push: dict | None = None,  # replica 1's last push of "w", where it differs
    replicas: int = 2,
    code: int = 0,
    log: str = "",
    config: str | None = None,
    rows=(("p0-a", "p0-b"), ("p1-a", "p1-b")),
    advantages=(0.7, 0.7),
    stepped=(1 / 2.000001, 1 / 2.000001),  # clip_grad 1.0 over the global norm 2.0
    optimizer_steps: bool = True,
    engine_class: str = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead",
    expect_engine: str = "",
    replay: dict | None = None,  # observe/replay.json; the case declares its reference with it
    later: dict | None = None,  # a second optimizer step: what differs from the first
    batches: int | None = None,  # mini-batches train_batch was handed (default: one a step)
    pair: tuple | None = None,  # each rank's micro-batch pair; the case declares it with it
):
    """A run folder as the trainer entry and the observer leave it, then read as the plugin does."""
    out = tmp_path / "run"
    folder = TrainerFolder(out)
    folder.observe.mkdir(parents=True)
    try:  # a config the test leaves unreadable on purpose counts one update a step
        resolved = json.loads(config) if config else verl_config(flag)
    except json.JSONDecodeError:
        resolved = {}
    written = 2 if later is not None else max(1, len((replay or {}).get("steps", ())))
    spec = TrainerSpec(
        "t",
        DeviceKind.CPU,
        2,
        "/model",
        ("a=b",),
        timeout_s=600.0,
        reference=replay is not None,
        micro_batch_pair=pair is not None,
        # as many training steps as the optimizer steps written make, at the config's updates
        total_training_steps=max(1, written // updates_per_step(resolved)),
    )
    spec.write(folder.spec)
    if replay:
        folder.replay.write_text(json.dumps(replay))
    folder.resolved_config.parent.mkdir(parents=True)
    folder.resolved_config.write_text(config or json.dumps(verl_config(flag)))  # JSON is YAML
    params = {"w": {"float32": "d", "bfloat16": "b"}}
    for rank in (0, 1):
        step = {
            "reduce_scatters_by_micro_batch": list(calls[rank]),
            # FSDP2's reduce-scatters, and no other collective carried a gradient
            "gradient_collectives_by_micro_batch": [
                {"reduce_scatter": n} if n else {} for n in calls[rank]
            ],
            "retained_grad_bytes": [retained[rank]],
            "shard_group_size": 2,
            "fsdp_units": 5,
            "shard_grad_sq": shard_sq[rank],
            "reported_grad_norm": reported[rank],
            "rows": list(rows[rank]),
            "advantages_abs_max": advantages[rank],
            "stepped_scale": stepped[rank],
            "stepped_residual": 0.0,
            "micro_batch_pair": None if pair is None else pair[rank],
        }
        steps = [step] * written
        if later is not None:
            steps = [step, {**step, **{k: v[rank] for k, v in later.items()}}]
        steps = steps if optimizer_steps else []
        data = {"rank": rank, "pid": 1, "steps": steps, "batches": batches or max(1, len(steps))}
        data["engine_class"] = engine_class
        data["post_step_parameters"] = params if rank == 0 else {}
        folder.rank(rank).write_text(json.dumps(data))
    for pid in range(replicas):
        fresh = {"received": "float32", "float32": "d", "bfloat16": "b"}  # the trainer's, after
        stale = {"received": "float32", "float32": "old", "bfloat16": "old-b"}
        pushes = [{"w": stale}, {"w": (push or fresh) if pid else fresh}]
        folder.replica(pid).write_text(json.dumps({"pushes": pushes}))
    folder.step_metrics.write_text(
        json.dumps({"1": {"actor/grad_norm": verl_norm, "critic/score/mean": 0.2}})
    )
    folder.log.write_text(log)
    case = TrainerCase("t", "tiny-qwen3-chat", ("a=b",), engine_class=expect_engine)
    return read_run(case, spec, out, code, 1.0, False)


def failed(result) -> dict[str, str]:
    return {o.check: o.detail for o in checks.evaluate(result).with_status(checks.FAILED)}


def test_a_healthy_trainer_run_passes_a_e_h_and_says_what_it_cannot_have(tmp_path):
    result = observed_run(tmp_path)
    verdict = checks.check_all(result)
    assert {o.check for o in verdict.with_status(checks.PASSED)} == {"a", "e", "h", "j", "k"}
    said = verdict.not_applicable()
    assert "c: no reference declared (the trainer case's `reference`)" in said, said
    assert {line[0] for line in said} == {"b", "c", "d", "f", "i", "l"}, said
    assert result.metrics["critic/score/mean"] == 0.2
    assert result.metrics["comm/reduce_scatter_calls"] == 10
    # spec.json holds what a reader of the run needs of its case, as every case's does
    assert (result.spec().case_id, result.spec().timeout_s) == ("t", 600.0)
    # its tolerances and its golden follow the dtype verl computes in (FSDP's mixed precision)
    assert (result.spec().engine.dtype, result.spec().golden_dtype) == ("bf16", "bf16")
    # spec.json holds what verl's config declares and nothing padded: this config names no lr,
    # betas or prompt count, so neither does the spec
    written = json.loads(RunFolder(result.artifacts_dir).spec.read_text())
    assert written["kind"] == "verl_trainer"
    assert not {"lr", "adam_beta1", "weight_decay"} & set(written["engine"]), written["engine"]
    assert not {"num_prompts", "max_new_tokens", "lm_loss_coef"} & set(written["ppo"])
    assert written["ppo"]["n"] == 2 and written["ppo"]["rollout_dtype"] == "float32"
    from pytest_fsdp_turbo.checks.goldens import golden_key

    assert golden_key(result).path(tmp_path).name == "cpu-bf16-ws2.json"


def test_an_unreadable_verl_config_is_still_a_trainer_run_and_e_fails_in_one_line(tmp_path):
    result = observed_run(tmp_path, config="{unclosed: [")
    assert "verl's resolved config cannot be read" in result.failure
    # spec.json names the kind and what the case declared, nothing the config would have
    written = json.loads(RunFolder(result.artifacts_dir).spec.read_text())
    assert written["kind"] == "verl_trainer" and written["ppo"] == {}
    assert written["engine"] == {"world_size": 2}
    problem = failed(result)["e"]
    assert "verl's resolved config was not read" in failed(result)["h"]  # nothing declared
    assert problem.startswith("check e: the run's spec.json declares no rollout replicas")
    assert "\n" not in problem


@pytest.mark.parametrize(
    ("changes", "check", "words"),
    [
        ({"flag": True}, "h", "expected reduce-scatters per micro-batch [0, 5], measured [5, 5]"),
        ({"flag": True, "calls": ((0, 5), (0, 5))}, "h", "expected unsharded gradients held"),
        ({"retained": (8, 8)}, "h", "expected no unsharded gradients held"),
        ({"reported": (2.0, 1.5)}, "a", "differs from rank 0's"),
        (
            {"shard_sq": (2.0, 1.0), "stepped": (1 / (3**0.5 + 1e-6),) * 2},
            "a",
            "global L2 norm of the sharded gradients is",
        ),
        ({"verl_norm": 3.0}, "a", "verl's step metric actor/grad_norm = 3.0"),
        (
            {"push": {"received": "float32", "float32": "old", "bfloat16": "old-b"}},
            "e",
            "a stale or wrong push",
        ),
        # bf16 weights pushed into a float32 rollout: its bytes are the trainer's, in bf16
        (
            {"push": {"received": "bfloat16", "bfloat16": "b", "float32": "b-widened"}},
            "e",
            "it came in bfloat16, the trainer's own weights in that dtype, which the rollout "
            "serves in float32 (actor_rollout_ref.rollout.dtype): a push cast on the way",
        ),
        ({"replicas": 1}, "e", "1 rollout replica(s) received weights"),
        ({"reported": (math.nan, math.nan)}, "a", "expected a finite value"),
        # an engine that multiplies its loss by 0: no gradient, advantages that are not 0
        (
            {"reported": (0.0, 0.0), "shard_sq": (0.0, 0.0), "verl_norm": 0.0, "stepped": (1, 1)},
            "a",
            "= 0 on a step whose advantages are not all zero",
        ),
        # data ranks handed the same mini-batch (one token-identical response is no such thing)
        (
            {"rows": (("p0-a", "p0-b"), ("p0-b", "p0-a"))},
            "j",
            "ranks [0, 1] trained on the same rows",
        ),
        ({"stepped": (1.0, 1.0)}, "k", "the optimizer stepped on gradients 1 away"),
        ({"stepped": (0.0, 0.0)}, "k", "the optimizer stepped on gradients 1 away"),
    ],
)
def test_each_trainer_check_fails_on_the_bug_it_claims(tmp_path, changes, check, words):
    problems = failed(observed_run(tmp_path, **changes))
    assert set(problems) == {check}, problems
    assert words in problems[check]


def test_the_micro_batch_pair_holds_each_parameter_to_its_one_pass_gradient(tmp_path):
    """Each rank's shard sums, added up per parameter: the worst parameter's relative L2
    distance, judged by h against the dtype's tolerance; declared and not measured is red."""
    from pytest_fsdp_turbo.checks.tolerances import MICRO_BATCH_PAIR_TOL

    tolerance = MICRO_BATCH_PAIR_TOL["bf16"]
    healthy = ({"w": [0.0, 4.0], "b": [0.0, 1.0]}, {"w": [0.0, 4.0], "b": [0.0, 1.0]})
    result = observed_run(tmp_path / "healthy", pair=healthy)
    assert "h" not in failed(result)
    assert result.metrics["sync/micro_batch_pair_rel_l2"] == 0.0
    # b: sqrt((x + x) / (1 + 1)) = 2 tolerances off, on two ranks' shards together
    off = (2 * tolerance) ** 2
    broken = ({"w": [0.0, 4.0], "b": [off, 1.0]}, {"w": [0.0, 4.0], "b": [off, 1.0]})
    problem = failed(observed_run(tmp_path / "broken", pair=broken))["h"]
    assert (
        "the micro-batch pair: parameter b's gradient over the 2 micro-batches differs from one "
        f"pass of the same mini-batch through the same engine by {2 * tolerance:.3g}"
    ) in problem, problem
    unpaired = failed(observed_run(tmp_path / "unpaired", pair=(healthy[0], None)))["h"]
    assert "metric 'sync/micro_batch_pair_rel_l2' missing" in unpaired, unpaired


def test_the_pairs_distance_is_per_parameter_over_every_ranks_shard():
    from pytest_fsdp_turbo.trainer.readings import pair_distance

    # a parameter no gradient reached in either pass is equal; one reached in one pass only is not
    assert pair_distance([{"w": [0.0, 0.0]}, {"w": [0.0, 0.0]}], 2) == (0.0, "w")
    assert pair_distance([{"w": [1.0, 0.0]}, {"w": [0.0, 0.0]}], 2) == (math.inf, "w")
    assert pair_distance([{"a": [1.0, 4.0], "b": [0.0, 4.0]}, {"a": [0.0, 0.0]}], 2) == (0.5, "a")
    nan = pair_distance([{"a": [math.nan, 1.0], "b": [1.0, 1.0]}, {}], 2)
    assert nan is not None and math.isnan(nan[0]) and nan[1] == "a"
    assert pair_distance([{"w": [0.0, 1.0]}, None], 2) is None  # a rank that did not pair
    assert pair_distance([{"w": [0.0, 1.0]}], 2) is None
    assert pair_distance([{}, {}], 2) is None  # nothing compared


def test_a_failed_trainer_shows_its_cause_first(tmp_path):
    log = (
        "ray init kwargs: {}\n"
        "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m UserWarning: something harmless\n"
        "\x1b[36m(WorkerDict pid=2)\x1b[0m Traceback (most recent call last):\n"
        "\x1b[36m(WorkerDict pid=2)\x1b[0m ValueError: vllm version None not supported\n"
        "Error executing job with overrides: [...]\n"
    )
    result = observed_run(tmp_path, code=1, log=log)
    assert not result.ok
    head = result.failure_text().splitlines()[0]
    assert head == "case t: verl's trainer exited 1: ValueError: vllm version None not supported"
    assert first_cause(tmp_path / "missing.log") == "(no log)"


def test_strict_on_an_8_npu_box_says_the_16_npu_case_cannot_run(pytester):
    pytester.makefile(".toml", cases=(REPO / "e2e" / "cases.toml").read_text())
    pytester.makepyfile(
        "def test_t(fsdp_turbo_trainer_case, verl_trainer_run):\n"
        "    verl_trainer_run(fsdp_turbo_trainer_case)\n"
    )
    args = ["--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=npu:8", "-p", "no:cacheprovider"]
    result = pytester.runpytest(*args, "-k", "fsdp8-sp2", "--fsdp-turbo-strict")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*none can run here: needs 16 npu devices; found 8*"])
    listed = pytester.runpytest(*args, "--collect-only", "-q", "-m", "npu_e2e")
    listed.stdout.fnmatch_lines(["*qwen3_5-2b-verl-trainer-fsdp_turbo-fsdp4-sp2-npu*"])


@pytest.mark.parametrize(
    ("kind", "sizes", "overlap"),
    [
        ("cuda", (2, 2), [False, False]),
        ("cpu", (2, 2), [False, True]),
        ("cpu", (4, 2), [False, False]),
        ("cpu", (8, 2), [False, False]),
    ],
)
def test_trainer_runs_on_one_host_take_turns_but_on_cpu_as_memory_holds(
    tmp_path, monkeypatch, kind, sizes, overlap
):
    """verl names its weight-sync sockets by Ray job id, the same in every fresh cluster: two
    trainer runs at once on one host hang each other, so the second waits for the first; on
    CPU the harness's shim names each run's sockets apart (cpu.py shim 10), and runs overlap as
    far as the host's memory holds their ranks (here 5: two 2-rank runs, a 4-rank run alone, a
    run larger than the host alone, never refused)."""
    import threading
    import time

    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo.trainer import host_turns

    monkeypatch.setattr(host_turns, "cpu_rank_slots", lambda: 5)
    books = [LeaseBook(tmp_path) for _ in sizes]  # one per xdist worker, one state folder
    cases = [
        TrainerCase(
            "t",
            "tiny-qwen3-chat",
            ("actor_rollout_ref.rollout.name=vllm",),
            world_size=n,
            timeout=60.0,
        )
        for n in sizes
    ]
    inside: list[int] = []
    seen: list[bool] = []
    started = threading.Barrier(2)

    def run(book: LeaseBook, case: TrainerCase) -> None:
        started.wait()
        with host_turns.one_trainer_per_host(book, kind, case):
            inside.append(1)
            time.sleep(0.3)
            seen.append(len(inside) > 1)
            inside.pop()

    threads = [threading.Thread(target=run, args=pair) for pair in zip(books, cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == overlap


def test_a_large_cpu_trainer_run_is_not_starved_by_smaller_runs_that_ask_again(
    tmp_path, monkeypatch
):
    """Seen in CI: a 4-rank run waited 900 s while another worker's 2-rank runs took the slots
    back to back. Here two workers each run 2-rank cases one after another on 4 slots, which are
    never all free at once; a 4-rank run that asks while both hold goes next."""
    import threading
    import time

    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo.trainer import host_turns

    monkeypatch.setattr(host_turns, "cpu_rank_slots", lambda: 4)
    vllm = ("actor_rollout_ref.rollout.name=vllm",)
    small = TrainerCase("small", "tiny-qwen3-chat", vllm, world_size=2, timeout=60.0)
    large = TrainerCase("large", "tiny-qwen3-chat", vllm, world_size=4, timeout=60.0)
    entered: list[str] = []
    first_runs = threading.Barrier(3)

    def small_runs(name: str) -> None:
        book = LeaseBook(tmp_path)
        for run in range(3):
            with host_turns.one_trainer_per_host(book, "cpu", small):
                entered.append(f"{name}{run}")
                if run == 0:
                    first_runs.wait(timeout=30)  # both small runs hold their slots
                    deadline = time.monotonic() + 30
                    while not book.holders()["turns"] and time.monotonic() < deadline:
                        time.sleep(0.01)  # until the large run has asked
                time.sleep(0.02)

    def large_run() -> None:
        first_runs.wait(timeout=30)
        with host_turns.one_trainer_per_host(LeaseBook(tmp_path), "cpu", large):
            entered.append("large")

    threads = [threading.Thread(target=small_runs, args=(name,)) for name in "ab"]
    threads.append(threading.Thread(target=large_run))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(entered) == 7  # the two first small runs together, then the large run first
    assert sorted(entered[:2]) == ["a0", "b0"] and entered[2] == "large", entered


@pytest.mark.parametrize(
    ("cores", "gib", "slots"), [(2, 24, 2), (16, 24, 6), (16, 128, 16), (1, 1, 1), (8, 3, 1)]
)
def test_cpu_trainer_ranks_share_a_host_by_cores_and_memory(monkeypatch, cores, gib, slots):
    """One core and 4 GiB per CPU trainer rank; a host smaller than one rank still runs one."""
    from types import SimpleNamespace

    from pytest_fsdp_turbo.trainer import host_turns

    monkeypatch.setattr(host_turns.os, "cpu_count", lambda: cores)
    memory = SimpleNamespace(total=gib * 2**30)
    monkeypatch.setattr(host_turns.psutil, "virtual_memory", lambda: memory)
    assert host_turns.cpu_rank_slots() == slots


def test_each_cpu_runs_weight_sync_sockets_carry_its_own_name():
    pytest.importorskip("torch")
    from pytest_fsdp_turbo_engine.trainer.cpu import run_name, run_own

    verls = "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-1.sock"
    names = set()
    for run in ("/a/run", "/b/run", "/a/run"):
        named = run_own(verls, run_name(Path(run)))
        assert named.startswith("ipc:///tmp/rl-colocate-zmq-") and named.endswith(verls[27:])
        names.add(named)
    assert len(names) == 2  # one per run, the same at both ends of one run
    with pytest.raises(RuntimeError, match="no longer starts 'ipc:///tmp/rl-colocate-zmq-'"):
        run_own("ipc:///var/run/verl-sync.sock", "x")


def test_each_sample_of_a_cpu_trainer_step_gets_its_own_seed_on_any_replica():
    """Shim 11 seeds every request from verl's rollout seed and the sample's place in the step
    (verl's AgentLoopWorker._run_agent_loop gets both), not from the replica that serves it: the
    same sample draws the same tokens run after run; a seed verl gives is kept."""
    pytest.importorskip("torch")
    import asyncio
    from types import SimpleNamespace

    from pytest_fsdp_turbo_engine.trainer import cpu

    class AgentLoopWorker:  # verl's (experimental/agent_loop/agent_loop.py), its seed and call
        rollout_config = SimpleNamespace(seed=42)

        async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True):
            return sampling_params.get("seed")

    cpu._seed_each_sample(SimpleNamespace(AgentLoopWorker=AgentLoopWorker))
    worker = AgentLoopWorker()

    def seed_of(params, step, index, n):
        where = {"step": step, "sample_index": index, "rollout_n": n, "validate": False}
        return asyncio.run(worker._run_agent_loop(params, where, agent_name="single_turn_agent"))

    # measured through main_ppo: verl's rollout_n gave both responses of a prompt one seed (0 on
    # each), so the shim counts a prompt's rows itself; here they arrive apart
    rows = [(1, i, 0) for i in range(3)] * 2 + [(2, 0, 0)]
    seeds = [seed_of({"temperature": 1.0}, *where) for where in rows]
    assert len(set(seeds)) == len(rows) and all(0 <= s < 2**31 for s in seeds)
    assert seeds[0] == cpu.sample_seed(42, 1, 0, 0) and seeds[3] == cpu.sample_seed(42, 1, 0, 1)
    cpu._seed_each_sample(SimpleNamespace(AgentLoopWorker=AgentLoopWorker))  # the next run
    again = [seed_of({"temperature": 1.0}, *where) for where in rows]
    assert again == seeds
    assert seed_of({"seed": 7}, 1, 0, 0) == 7


def test_both_ends_of_verls_weight_sync_get_the_runs_socket(tmp_path):
    """Shim 10 wraps the trainer's ServerAdapter (its zmq_handle, set in __init__) and vLLM's
    worker extension (_get_zmq_handle): both ends name the same socket, with the run's name."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from pytest_fsdp_turbo_engine.trainer import cpu

    verls = "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock"

    class ServerAdapter:  # verl's builds its handle in __init__ (vllm_rollout.py)
        def __init__(self, config):
            self.zmq_handle = verls

    class vLLMColocateWorkerExtension:  # verl's receiver (vllm_rollout/utils.py)
        def _get_zmq_handle(self):
            return verls

    trainer = SimpleNamespace(ServerAdapter=ServerAdapter)
    rollout = SimpleNamespace(vLLMColocateWorkerExtension=vLLMColocateWorkerExtension)
    name = cpu.run_name(tmp_path)
    cpu._run_own_sockets_trainer(trainer, name)
    cpu._run_own_sockets_rollout(rollout, name)
    sender = ServerAdapter(config=None).zmq_handle
    assert sender == vLLMColocateWorkerExtension()._get_zmq_handle() != verls
    assert name in sender and sender.endswith("01000000-replica-0-rank-0.sock")


def test_verl_imports_the_observer_first_then_the_users_modules_then_the_cases(tmp_path):
    """The user's VERL_USE_EXTERNAL_MODULES (a platform plug-in) and the case's travel in the
    trainer's spec.json; the entry puts the harness's observer before them, each module once."""
    from pytest_fsdp_turbo_contract.trainer_spec import OBSERVER_MODULE
    from pytest_fsdp_turbo_engine.trainer.main import external_modules

    path = tmp_path / "spec.json"
    modules = ("my.platform", "my.engine", "my.platform")
    TrainerSpec("t", DeviceKind.CPU, 2, "/m", (), external_modules=modules).write(path)
    spec = TrainerSpec.read(path)
    assert spec.external_modules == modules
    assert external_modules(spec) == f"{OBSERVER_MODULE},my.platform,my.engine"


def test_config_with_a_mistyped_id_lists_the_trainer_cases_too_and_takes_cpu(capsys):
    from pytest_fsdp_turbo.cli import main

    assert main(["config", "tiny-qwen3-verl-trainer-fsdp"]) == 2
    missed = capsys.readouterr().err
    assert "no case 'tiny-qwen3-verl-trainer-fsdp'; known: " in missed
    assert "tiny-qwen3-verl-trainer-fsdp2-deferred" in missed  # a trainer case's id
    assert "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred" in missed  # an engine case's
    assert main(["config", "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred", "--device", "cpu"]) == 0
    assert '"ulysses_parallel_size": 2' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("hydra.output_subdir=/tmp/x", "no override of Hydra's own output"),
        ("hydra.job_logging.handlers.file.filename=/tmp/x.log", "no override of Hydra's own"),
        ("hydra.run.dir=/tmp/x", "no override of Hydra's own output"),
        ("trainer.n_gpus_per_node=$NOT_SET_ANYWHERE", "$NOT_SET_ANYWHERE set in the case's env"),
        ("trainer.n_gpus_per_node=two", "a whole number of devices or nodes"),
    ],
)
def test_overrides_the_harness_owns_or_cannot_count_are_refused(tmp_path, override, expected):
    text = BASE.replace('"trainer.n_gpus_per_node=2"', json.dumps(override))
    with pytest.raises(ConfigError, match="field 'overrides'") as err:
        book(tmp_path, text)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_world_size_from_variables_is_counted_as_the_shell_would(tmp_path, monkeypatch):
    monkeypatch.setenv("NGPUS", "2")
    text = BASE.replace('"trainer.n_gpus_per_node=2"', '"trainer.n_gpus_per_node=${NGPUS}"')
    assert book(tmp_path, text).get_trainer("t").world_size == 2
    two_by_two = text.replace("${NGPUS}", "$A", 1).replace(
        "overrides = [", 'env = { A = "2", B = "2" }\noverrides = ["trainer.nnodes=$B", ', 1
    )
    with pytest.raises(ConfigError, match=r"from the overrides \(4\)"):
        book(tmp_path, two_by_two)  # $A x $B is 4, not the case's 2


def test_a_script_is_read_whole_or_refused_in_one_line(tmp_path):
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main_ppo a=1 $EXTRA\n")
    text = BASE + 'script = "run.sh"\n'
    with pytest.raises(ConfigError, match="'\\$EXTRA' after verl.trainer.main_ppo holds overrides"):
        book(tmp_path, text)
    (tmp_path / "run.sh").write_bytes(b"python3 -m verl.trainer.main_ppo a=\xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        book(tmp_path, text)
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main_ppo 'a=1\nb=2'\n")
    with pytest.raises(ConfigError, match="line 1: an override runs over lines; keep each"):
        book(tmp_path, text)
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main_ppo 'a=1\n")
    with pytest.raises(ConfigError, match="run.sh: line 1: No closing quotation"):
        book(tmp_path, text)
    # a quoted string over lines elsewhere (a banner) is shell the script may hold
    banner = 'echo "training\n  starts"\npython3 -m verl.trainer.main_ppo a=1\n'
    (tmp_path / "run.sh").write_text(banner)
    assert book(tmp_path, text).get_trainer("t").overrides[0] == "a=1"
    # the shell's redirections end the command's words, as its operators do
    (tmp_path / "run.sh").write_text(
        "python3 -m verl.trainer.main_ppo a=1 2>err.log\npython3 -m verl.trainer.main_ppo b=2 &> l\n"
    )
    assert book(tmp_path, text).get_trainer("t").overrides[0] == "a=1"
    for tail in ("< /dev/null", "|& tee log", "> log 2>&1"):
        (tmp_path / "run.sh").write_text(f"python3 -m verl.trainer.main_ppo a=1 {tail}\n")
        assert book(tmp_path, text).get_trainer("t").overrides[:2] == (
            "a=1",
            "trainer.n_gpus_per_node=2",
        )
    # a word that is no override (Hydra's --config-name, a typo) is named, never dropped
    (tmp_path / "run.sh").write_text("python3 -m verl.trainer.main_ppo a=1 --config-name x b=2\n")
    with pytest.raises(
        ConfigError, match="'--config-name' after verl.trainer.main_ppo is no Hydra"
    ):
        book(tmp_path, text)


def test_a_size_given_as_a_word_in_verls_config_is_one_line_naming_the_key():
    config = verl_config(False)
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = "two"
    with pytest.raises(ConfigError) as err:
        declared(config, 2)
    assert str(err.value) == (
        "verl's config: actor_rollout_ref.actor.ppo_mini_batch_size: expected a whole number; "
        "got 'two'"
    )
    config = verl_config(False)
    config["actor_rollout_ref"]["actor"]["optim"]["clip_grad"] = "big"
    with pytest.raises(ConfigError) as err:
        declared(config, 2)
    assert str(err.value) == (
        "verl's config: actor_rollout_ref.actor.optim.clip_grad: expected a number; got 'big'"
    )


def test_an_engine_that_never_steps_is_named_with_the_line_that_says_why(tmp_path):
    warning = (
        "\x1b[36m(WorkerDict pid=2)\x1b[0m UserWarning: Detected call of `lr_scheduler.step()` "
        "before `optimizer.step()`.\n"
    )
    result = observed_run(tmp_path, optimizer_steps=False, log="noise\n" + warning)
    head = result.failure_text().splitlines()[0]
    assert "verl's engine on rank(s) [0, 1] trained on the mini-batch the actor handed it" in head
    assert "but the optimizer never stepped" in head
    assert "the log says: UserWarning: Detected call of `lr_scheduler.step()`" in head
    text = result.failure_text()
    assert "did it call exit" not in text  # an engine case's words, not a trainer's
    assert "no reading of rank 1: its run ended without one" in text
    assert text.count("noise") == 1  # the one trainer log the ranks share, shown once
    from pytest_fsdp_turbo.report import run_cause

    cause = run_cause(result)  # the summary's cell: cut at a word, never mid-word
    assert cause.endswith("...") and len(cause) <= 60, cause
    assert result.failure.startswith(cause[:-3]) and result.failure[len(cause) - 3] in " ,;:"


def test_the_summary_row_names_the_engine_class_that_trained(tmp_path):
    """A registration that missed would run verl's own engine: the row says which class ran."""
    from pytest_fsdp_turbo.report import render_table, summary_row

    result = observed_run(tmp_path, engine_class="my_fork.engines.MyEngine")
    checks.check_all(result)
    row = json.loads(summary_row(result, "test_one_step"))
    assert row["engine"] == "my_fork.engines.MyEngine"
    table = render_table([(row, "passed", "")])
    assert " t (MyEngine) " in table[1] and "passed: a e h j k" in table[1], table


def test_a_mini_batch_trained_without_its_optimizer_step_is_the_runs_failure(tmp_path):
    result = observed_run(tmp_path, batches=2)
    head = result.failure_text().splitlines()[0]
    assert "trained on the mini-batch the actor handed it (train_batch) but the optimizer " in head
    assert "skipped a step (rank 0: 2 mini-batch(es), 1 step(s), rank 1: 2" in head, head


def test_verls_own_push_in_the_parameters_dtype_into_a_bf16_rollout_passes_e(tmp_path):
    """verl pushes fp32 parameters and vLLM casts them to its bf16: e compares in bf16."""
    config = verl_config(False)
    config["actor_rollout_ref"]["rollout"]["dtype"] = "bfloat16"
    result = observed_run(tmp_path, config=json.dumps(config))
    assert result.spec().ppo.rollout_dtype == "bfloat16"
    assert "e" not in failed(result)
    auto = observed_run(tmp_path / "auto", config=json.dumps(config).replace("bfloat16", "auto"))
    assert auto.spec().ppo.rollout_dtype is None and "e" not in failed(auto)  # as received


def test_one_token_identical_response_on_two_ranks_is_no_shared_row(tmp_path):
    result = observed_run(tmp_path, rows=(("p0-a", "same"), ("same", "p1-b")))
    assert "j" not in failed(result)
    assert [r.metrics["sync/data_rows"] for r in result.ranks] == [[0, 1], [2, 3]]


def test_overrides_that_are_no_list_are_refused_before_a_base_case_adds_to_them(tmp_path):
    text = BASE + '\n[[trainer_case]]\nid = "t2"\nextends = "t"\noverrides = "ab"\n'
    with pytest.raises(ConfigError, match="trainer case 't2': field 'overrides': expected a list"):
        book(tmp_path, text)


def test_the_engine_class_that_trained_is_recorded_and_a_missed_registration_is_red(tmp_path):
    verls = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    result = observed_run(tmp_path / "any")
    assert result.metrics["rank/engine"] == verls  # in junit too: report.JUNIT_METRICS
    assert observed_run(tmp_path / "named", expect_engine="FSDPEngineWithLMHead").ok
    missed = observed_run(tmp_path / "missed", expect_engine="acme.engines.AcmeEngine")
    head = missed.failure_text().splitlines()[0]
    assert "expects engine class acme.engines.AcmeEngine; rank 0 trained with " + verls in head
    assert "a registration that missed" in head


# --- the single-process reference's replay, judged every step ------------------------------------

HEALTHY_STEP = {
    "rows": 4,
    "tokens": 64,
    "grad_max_rel_err": 0.03,
    "grad_max_rel_err_param": "model.norm.weight",
    "grad_rel_l2_err": 0.016,
    "reference_grad_norm": 2.0,
    "old_logprob_max_abs_diff": 0.028,
    "loss_grad_max_rel_err": 1e-4,
    "loss_grad_rows": 4,
    "update_max_err_lr": 2e-4,
    "update_max_err_param": "lm_head.weight",
    "update_rel_l2_err": 0.14,
    "grad_rel_l2_noise": 0.011,
    # per parameter: [from the reference's gradient in bf16, that one's from fp32]
    "grad_param_rel_l2": {"model.norm.weight": [0.012, 0.011], "lm_head.weight": [0.01, 0.012]},
    "old_logprob_noise": 0.02,
    "update_rel_l2_noise": 0.12,
}


def replay_of(*steps: dict, **top) -> dict:
    steps_ = [{"step": n, **HEALTHY_STEP, **s} for n, s in enumerate(steps)]
    return {"steps": steps_, "complete": True, **top}


def test_a_replayed_healthy_run_passes_every_check_on_every_step(tmp_path):
    result = observed_run(tmp_path, replay=replay_of({}, {"old_logprob_max_abs_diff": None}))
    verdict = checks.check_all(result)
    passed = {o.check for o in verdict.with_status(checks.PASSED)}
    assert passed == {"a", "b", "c", "e", "h", "i", "j", "k", "l"}, verdict.not_applicable()
    assert result.metrics["sync/grad_rel_l2_err"] == 0.016  # step 0, in the summary and junit


@pytest.mark.parametrize(
    ("step", "check", "words"),
    [
        # halved gradients: 0.5 from the reference, 45 x what bf16 costs the reference itself
        ({"grad_rel_l2_err": 0.5}, "c", "step 1: the engine's gradients differ from the single"),
        # one small parameter's gradient zeroed: the whole gradient barely moves
        (
            {"grad_param_rel_l2": {**HEALTHY_STEP["grad_param_rel_l2"], "A_log": [1.0, 0.02]}},
            "c",
            "step 1: parameter A_log: its gradient differs from the single-process reference's in "
            "bf16 by relative L2 error 1, 50 times",
        ),
        ({"grad_param_rel_l2": None}, "c", "step 1: the run computes in bf16, but the replay"),
        ({"old_logprob_max_abs_diff": 0.5}, "b", "step 1: the old log-probs verl trained with"),
        ({"update_max_err_lr": 1.0}, "i", "from AdamW in closed form on the engine's own"),
        ({"update_rel_l2_err": 1.0}, "i", "the update differs from the reference's"),
        ({"loss_grad_max_rel_err": 0.5}, "l", "the loss was scaled, masked or aggregated"),
        ({"loss_grad_rows": 3}, "l", "caught the loss gradient of 3 of 4 rows"),
        ({"reference_grad_norm": 4.0}, "a", "step 1: rank 0: actor/grad_norm = 2, the single-"),
        (
            {"ref_logprob_max_abs_diff": 0.3, "ref_logprob_noise": 0.02},
            "b",
            "step 1: the reference policy's log-probs verl's KL loss used differ",
        ),
        (
            {"continuity_max_abs": 1e-7, "continuity_param": "w"},
            "i",
            "step 1: parameter w before the step differs from where step 0 left it by 1e-07",
        ),
        ({"problem": "not captured: grads.pt"}, "c", "step 1: not captured: grads.pt"),
    ],
)
def test_each_reference_check_fails_on_a_later_step_alone(tmp_path, step, check, words):
    """Every step is judged on its own: a bug on step 1 alone is red, naming the step."""
    problems = failed(observed_run(tmp_path, replay=replay_of({}, step), reported=(2.0, 2.0)))
    assert check in problems and words in problems[check].splitlines()[0], problems
    if "problem" not in step:
        assert set(problems) == {check}, problems


def test_a_declared_reference_without_its_replay_fails_and_a_refusal_says_why(tmp_path):
    result = observed_run(tmp_path, replay={})
    assert "the replay wrote no readable record" in failed(result)["c"]
    refused = "actor_rollout_ref.actor.policy_loss.loss_mode=gspo: only 'vanilla' is modelled"
    result = observed_run(tmp_path / "r", replay={"refused": refused, "steps": []})
    said = checks.check_all(result).not_applicable()
    assert f"c: the reference refuses: {refused}" in said, said
    result = observed_run(tmp_path / "e", replay={"error": "the harness's reference replay failed"})
    assert "the harness's reference replay failed" in failed(result)["i"]


@pytest.mark.parametrize(
    ("later", "check", "words"),
    [
        ({"reduce_scatters_by_micro_batch": ([0, 5], [0, 5])}, "h", "step 1: trainer case t:"),
        # the reduce-scatters as declared, and each held gradient all-reduced after micro-batch 0
        (
            {
                "gradient_collectives_by_micro_batch": (
                    [{"all_reduce": 9, "reduce_scatter": 5}, {"reduce_scatter": 5}],
                    [{"all_reduce": 9, "reduce_scatter": 5}, {"reduce_scatter": 5}],
                )
            },
            "h",
            "step 1: trainer case t: verl's resolved config declares gradient_sync "
            "'every_micro_batch' (use_no_sync_for_gradient_accumulation) with 2 micro-batches "
            "over 5 FSDP units that ran, sharded 2 ways, 1 replica(s): expected gradient "
            "collectives per micro-batch [5 reduce_scatter, 5 reduce_scatter], measured "
            "[9 all_reduce + 5 reduce_scatter, 5 reduce_scatter] on rank 0",
        ),
        ({"reported_grad_norm": (2.0, 3.0)}, "a", "step 1: rank 1: actor/grad_norm = 3.0"),
        ({"rows": (("x", "y"), ("x", "y"))}, "j", "step 1: "),  # both ranks handed the same rows
        ({"stepped_scale": (1.0, 1.0)}, "k", "step 1: "),
    ],
)
def test_a_bug_on_a_later_optimizer_step_alone_is_red_naming_it(tmp_path, later, check, words):
    """Every optimizer step is judged by the checks every case has (the first training step
    averages its steps' norms into verl's metric, which the mean of rank 0's matches here)."""
    config = verl_config(False)
    config["actor_rollout_ref"]["actor"]["ppo_epochs"] = 2
    healthy = observed_run(tmp_path / "healthy", later={}, config=json.dumps(config))
    assert not failed(healthy), failed(healthy)
    assert healthy.spec().ppo.updates == 2
    result = observed_run(tmp_path / "broken", later=later, config=json.dumps(config))
    problems = failed(result)
    assert set(problems) == {check}, problems
    assert problems[check].startswith(f"check {check}: {words}"), problems[check]


def test_bugs_on_two_steps_of_one_run_are_each_named_the_first_steps_first(tmp_path):
    """h judges every step, so two bugs on different steps share one run (one verl start-up)."""
    config = verl_config(False)
    config["actor_rollout_ref"]["actor"]["ppo_epochs"] = 2
    # step 0: the second micro-batch's sync skipped; step 1: the reduce-scatters right, and three
    # gradients all-reduced by hand after the first micro-batch
    by_hand = [{"reduce_scatter": 5, "all_reduce": 3}, {"reduce_scatter": 5}]
    result = observed_run(
        tmp_path,
        calls=((5, 0), (5, 0)),
        later={
            "reduce_scatters_by_micro_batch": ([5, 5], [5, 5]),
            "gradient_collectives_by_micro_batch": (by_hand, by_hand),
        },
        config=json.dumps(config),
    )
    lines = failed(result)["h"].splitlines()
    assert lines[0].startswith("check h: trainer case t:"), lines
    assert "expected reduce-scatters per micro-batch [5, 5], measured [5, 0]" in lines[0]
    assert lines[1].startswith("check h: step 1: trainer case t:"), lines
    assert "measured [3 all_reduce + 5 reduce_scatter, 5 reduce_scatter]" in lines[1], lines
    # every check that judges each step notes every failed step on the run (the summary's cell)
    both = observed_run(
        tmp_path / "k",
        stepped=(1.0, 1.0),
        later={"stepped_scale": (1.0, 1.0)},
        config=json.dumps(config),
    )
    checks.evaluate(both)
    status, noted = both.judged["k"]
    assert [line[:17] for line in noted.splitlines()] == ["check k: rank 0: ", "check k: step 1: "]


def test_a_kl_loss_whose_reference_log_probs_were_never_replayed_fails_b(tmp_path):
    problems = failed(observed_run(tmp_path, replay=replay_of({}, kl_loss=True)))
    assert set(problems) == {"b"}, problems
    assert "declares a KL loss, but no replayed step holds the reference policy's" in problems["b"]
    judged = replay_of({"ref_logprob_max_abs_diff": 0.01, "ref_logprob_noise": 0.02}, kl_loss=True)
    assert not failed(observed_run(tmp_path / "judged", replay=judged))


def test_a_first_step_that_does_not_start_from_the_checkpoint_fails_i(tmp_path):
    moved = replay_of({"continuity_max_abs": 0.5, "continuity_param": "lm_head.weight"})
    problems = failed(observed_run(tmp_path, replay=moved))
    assert set(problems) == {"i"}, problems
    assert problems["i"].startswith(
        "check i: step 0: parameter lm_head.weight before the step differs from the checkpoint "
        "by 0.5: something changed the weights before the first step"
    ), problems["i"]


def test_a_replay_that_stopped_short_or_skipped_a_step_fails_every_reference_check(tmp_path):
    short = observed_run(tmp_path, replay=replay_of({}, {}, complete=False))
    problems = failed(short)
    assert {"b", "c", "i", "l"} == set(problems), problems
    assert "the replay covers steps [0, 1] of the 2 the observer saw" in problems["c"]
    assert "stopped short" in problems["c"]
    skipped = replay_of({}, {})
    skipped["steps"][1]["step"] = 2  # step 1 never replayed
    problems = failed(observed_run(tmp_path / "skipped", replay=skipped))
    assert "covers steps [0, 2] of the 2" in problems["i"], problems


def test_an_fsdp_turbo_trainer_case_puts_the_checkout_on_the_trainers_path_and_only_it(tmp_path):
    """verl's FSDP-Turbo engine imports `fsdp_turbo` in every worker: the checkout goes on the
    trainer's PYTHONPATH (Ray's workers inherit it); a case on another engine never asks for one,
    and a turbo case where none is given says what to set."""
    from pytest_fsdp_turbo.devices import Accelerator
    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo.trainer.run import TrainerRunner
    from pytest_fsdp_turbo.turbo.checkout import Checkout

    layout = tmp_path / "FSDPTurbo"
    layout.mkdir()
    (layout / "requirements.txt").write_text("torch\n")
    asked: list[int] = []

    def checkout():
        asked.append(1)
        return Checkout(layout, None, "a test's checkout")

    runner = TrainerRunner(Accelerator("cpu", (0,)), LeaseBook(tmp_path), tmp_path)
    turbo = TrainerCase("t", "tiny-qwen3-chat", ("actor_rollout_ref.actor.strategy=fsdp_turbo",))
    fsdp2 = TrainerCase("f", "tiny-qwen3-chat", ("actor_rollout_ref.actor.strategy=fsdp2",))
    with pytest.raises(
        Unavailable, match="t: verl's FSDP-Turbo engine needs an FSDPTurbo checkout"
    ):
        runner.library_paths(turbo)
    runner.checkout = checkout
    assert runner.library_paths(fsdp2) == () and not asked
    assert runner.library_paths(turbo) == (str(layout),) and asked == [1]


FAKE_TRAINER = """
import multiprocessing.util, sys, tempfile
from pathlib import Path

# what verl's processes leave when killed: multiprocessing's pymp-* folder, a temporary file
made = [multiprocessing.util.get_temp_dir(), tempfile.mkstemp()[1]]
Path(sys.argv[1], "made.txt").write_text("\\n".join(made))
sys.exit(3)
"""


def test_a_trainer_runs_temporary_files_go_with_the_run_whatever_its_end(tmp_path, monkeypatch):
    """Every process of the run keeps its temporary files (pymp-*, vLLM's, Ray's) in the run's
    own folder, removed after the run: a failed run leaves nothing in the box's TMPDIR."""
    from pytest_fsdp_turbo.devices import Accelerator
    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo.trainer import run

    site = tmp_path / "site"
    site.mkdir()
    (site / "fake_trainer_entry.py").write_text(FAKE_TRAINER)
    monkeypatch.setattr(run, "ENTRY_MODULE", "fake_trainer_entry")
    runner = run.TrainerRunner(
        Accelerator("cpu", (0, 1)), LeaseBook(tmp_path / "leases"), tmp_path / "art",
        pythonpath=(str(site),),
    )  # fmt: skip
    case = TrainerCase("t", "tiny-qwen3-chat", ("trainer.n_gpus_per_node=2",), timeout=60.0)
    result = runner._run(case, "t", tmp_path / "model", ())
    assert result.failure.startswith("verl's trainer exited 3"), result.failure
    made = (tmp_path / "art" / "t" / "made.txt").read_text().splitlines()
    scratch = json.loads((tmp_path / "art" / "t" / "env.json").read_text())["TMPDIR"]
    assert len(made) == 2 and all(Path(p).is_relative_to(scratch) for p in made), (made, scratch)
    assert not Path(scratch).exists() and not any(Path(p).exists() for p in made)


def test_a_step_verl_skipped_closes_the_training_pass_so_the_next_mini_batch_starts_one(tmp_path):
    """verl skips optimizer.step() on a norm that is not finite and goes on to the next
    mini-batch: the observer's pass ends with the engine's optimizer_step, so the next forward
    opens a fresh one (its collective counter too) instead of failing inside verl's forward."""
    from pytest_fsdp_turbo_engine.trainer.observer import TrainerRank

    folder = TrainerFolder(tmp_path)
    folder.observe.mkdir(parents=True)
    rank = TrainerRank(folder, 0)
    exited = []

    class Units:
        def __exit__(self, *exc):
            exited.append(True)

    torch = pytest.importorskip("torch")
    rank._pass, rank._units = {"module": torch.nn.Linear(2, 2)}, Units()
    rank.before_clip()  # the engine's optimizer_step begins: the counter comes off (none here)
    rank.reported(float("nan"))  # ... and returns without the optimizer having stepped
    assert rank._pass is None and rank._units is None and exited == [True]
    assert rank.steps == []  # nothing recorded for a step not taken: the run's failure says so


def test_a_run_that_stepped_fewer_times_than_its_case_asks_is_red_on_a(tmp_path):
    """`steps` reaches verl, and a run that took fewer is red: the harness counts the optimizer
    steps the observer saw against what it asked verl for (trainer_spec.json)."""
    result = observed_run(tmp_path)
    assert not failed(result), failed(result)
    folder = TrainerFolder(result.artifacts_dir)
    spec = TrainerSpec.read(folder.spec)
    dataclasses.replace(spec, total_training_steps=2).write(folder.spec)
    assert failed(result)["a"] == (
        "check a: the case asks for 2 training step(s) of 1 optimizer step(s) (verl's resolved "
        "config); the engine stepped 1 time(s)"
    )
