"""Artifacts, junit properties and the end-of-session table of e2e runs.

Rows travel in each test report's user_properties, so the table is complete under pytest-xdist too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_fsdp_turbo.checks import FAILED, PASSED, evaluate
from pytest_fsdp_turbo.options import PENDING_ROWS, SUMMARY_PROPERTY
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    STARTUP,
    TIMING_PREFIX,
    Reading,
    StepMetrics,
)
from pytest_fsdp_turbo_contract.results import read_json

if TYPE_CHECKING:
    from pytest_fsdp_turbo_contract.results import RunResult

COLUMNS = (
    "test",
    "case",
    "device",
    "ranks",
    "grad norm",
    "loss",
    "peak MiB",
    "retained MiB",
    "RS calls",
    "clipped",
    "start s",
    "step s",
    "verdict",
    "not applicable",
)


ARTIFACT_NAME_MAX = 150


# a node id whose folder name maps back to it one to one: a module path of letters, digits and
# '_' (folders joined by '.'), one test function (no class), one bracket of parameters of safe
# characters, nothing a folder name strips; anything else adds a digest of the id
_PLAIN_NODEID = re.compile(r"[A-Za-z0-9_/]+\.py(::[A-Za-z0-9_]+(\[[A-Za-z0-9_.-]*\])?)?")


def call_artifact_name(nodeid: str, call: int) -> str:
    """The folder of a test's `call`-th run (from 1): the node's own folder, then `+2`, `+3`, ...
    after it; '+' is a character artifact_name never writes, so a second run of one test never
    shares a folder with a test whose id ends in `-2`."""
    name = artifact_name(nodeid)
    return name if call == 1 else f"{name}+{call}"


def artifact_name(nodeid: str) -> str:
    """One folder per test node id, the same on every machine: the module's path (folders joined
    by '.', without .py), then the test and its parameters, e.g.
    `e2e.test_ppo_e2e.test_ppo_one_step-tiny-qwen3-cpu`; two node ids never share a folder. An id
    the plain name cannot tell apart from another (characters a folder name drops or changes, a
    name too long for a folder) keeps the name's start and adds a digest of the id."""
    module, _, test = nodeid.partition("::")
    module = module.removesuffix(".py").replace("/", ".").replace("\\", ".")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{module}.{test}" if test else module)
    name = re.sub(r"\.{2,}", ".", name).strip("-.")
    joined = f"{module}.{test.replace('[', '-').removesuffix(']')}" if test else module
    plain = _PLAIN_NODEID.fullmatch(nodeid) is not None and name == joined
    if not plain or len(name) > ARTIFACT_NAME_MAX:
        digest = hashlib.sha256(nodeid.encode()).hexdigest()[:12]
        name = f"{name[: ARTIFACT_NAME_MAX - 13]}-{digest}".lstrip("-")
    return name


JUNIT_METRICS = (
    Reading(lambda m: m.optimizer.grad_norm).key,
    Reading(lambda m: m.loss.pg_loss).key,
    Reading(lambda m: m.train.retained_grad_bytes).key,
    Reading(lambda m: m.train.reduce_scatter_calls).key,
    Reading(lambda m: m.loss.pg_clipfrac_last_update).key,
    Reading(lambda m: m.optimizer.clip_coef).key,
    Reading(lambda m: m.perf.peak_memory_bytes).key,
    Reading(lambda m: m.perf.step_time_s).key,
    TIMING_PREFIX + STARTUP,
    Reading(lambda m: m.rank.engine).key,  # a trainer run's engine class: which one ran
)


def junit_properties(result: RunResult) -> list[tuple[str, object]]:
    """A handful per run: where the artifacts are, whether the run completed, key metrics. The
    full metrics stay in the artifacts (rankN.metrics.json)."""
    props: list[tuple[str, object]] = [
        ("fsdp_turbo/artifacts", str(result.artifacts_dir)),
        ("fsdp_turbo/run", "completed" if result.ok else "failed"),
    ]
    props += [(str(key), result.metrics[key]) for key in JUNIT_METRICS if key in result.metrics]
    return props


# ppo_run options that say where a run comes from, not what it changes in the case
NOT_OVERRIDES = ("checkout", "extra_env", "engine_modules", "pythonpath", "launcher")
CAUSE_CHARS = 60


CHECK_CHARS = 140  # a failed check in the verdict column: its letter and numbers


def note_run(node: pytest.Item, result: RunResult, options: dict | None = None) -> None:
    """A run a test made: its junit properties now, its summary row when the test's call ends
    (pytest_fsdp_turbo.plugin), after the test's checks have judged it."""
    node.user_properties.extend(junit_properties(result))
    node.stash.setdefault(PENDING_ROWS, []).append((result, options or {}))


def write_rows(item: pytest.Item) -> None:
    """The summary row of every run the test made since the last call, into its properties."""
    pending = item.stash.get(PENDING_ROWS, [])
    for result, options in pending:
        row = summary_row(result, test=item.name, options=options)
        item.user_properties.append((SUMMARY_PROPERTY, row))
    pending.clear()


def _cut_at_a_word(text: str, most: int) -> str:
    """At most `most` characters, ended at a word with "..." where it had to be cut."""
    if len(text) <= most:
        return text
    return text[: most - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def check_in_numbers(detail: str) -> str:
    """A failed check's message cut to its letter and numbers: "c: rank 0: parameter w: gradient
    differs from the single-process reference by 0.31, tolerance 0.0001"; where that is still
    long, its last clause (what was expected and measured)."""
    text = (detail.strip().splitlines() or [""])[0].replace("(s)", "s")
    letter, _, text = re.sub(r"^check ([a-z]): (case \S+: )?", r"\1: ", text).partition(": ")
    aside = r" ?\((?:[^()\d]*|[^()]{40,}|[\w.]+/[\w.]+|log [^)]*)\)"  # no numbers, long, a key
    text = re.sub(r" ?\[sync policy [^\]]*\]", "", re.sub(aside, "", text))
    if len(text) > CHECK_CHARS:
        text = text.rsplit(": ", 1)[-1]
    cut = text if len(text) <= CHECK_CHARS else text[: CHECK_CHARS - 3] + "..."
    return f"{letter}: {cut}"


def summary_row(result: RunResult, test: str = "", options: dict | None = None) -> str:
    step = result.ranks[0].step if result.ranks else StepMetrics()
    overrides = {
        k: v for k, v in (options or {}).items() if k not in NOT_OVERRIDES and v is not None
    }
    row = {
        "test": test,
        "case": result.case_id,
        "engine": step.rank.engine,  # the class that trained, where the harness reads it
        "overrides": [f"{k}={v}" for k, v in sorted(overrides.items())],
        "cause": run_cause(result),
        "device": _spec_device(result),
        "ranks": ranks_cell(result),
        "grad_norm": step.optimizer.grad_norm,
        "loss": step.loss.pg_loss,
        "peak": step.perf.peak_memory_bytes,
        "retained": step.train.retained_grad_bytes,
        "rs_calls": step.train.reduce_scatter_calls,
        "clipped": clipped_cell(step),
        "start_s": step.timings.get(STARTUP),
        "step_s": step.perf.step_time_s,
        "ok": result.ok,
        "not_applicable": _not_applicable(result),
        "judged": {
            letter: [status, check_in_numbers(detail) if detail else ""]
            for letter, (status, detail) in sorted(result.judged.items())
        },
    }
    return json.dumps(row)


def clipped_cell(step: StepMetrics) -> str:
    """Both clips at work: the share of tokens PPO's clip held on the last update (of several),
    and the coefficient the gradients were scaled by: "0.49 tok, x0.22"."""
    parts = []
    if (share := step.loss.pg_clipfrac_last_update) is not None:
        parts.append(f"{share:.2g} tok")
    if (coef := step.optimizer.clip_coef) is not None and coef < 1:
        parts.append(f"x{coef:.2g}")
    return ", ".join(parts)


def ranks_cell(result: RunResult) -> str:
    """How many ranks, and on how many nodes when a launcher placed them (Ray): "4 (2 nodes)"."""
    nodes = {rank.node for rank in result.ranks if rank.node}
    return f"{result.world_size} ({len(nodes)} nodes)" if len(nodes) > 1 else str(result.world_size)


def run_cause(result: RunResult) -> str:
    """Why the run failed, in a few words ("" when it completed): the first failing rank, its phase
    and its exception type; a timeout; or why the group failed."""
    if result.ok:
        return ""
    if result.failure:  # the group's own cause first: a start-up bound that ran out, say
        return _cut_at_a_word(result.failure.splitlines()[0], CAUSE_CHARS)
    if result.timed_out:
        return f"timed out after {result.timeout_s:g}s"
    first = result.first_failed()
    if first is not None and first.error is not None and result.hung_in_a_collective:
        return f"rank {first.rank} {first.error.phase}: timed out in a collective"
    if first is not None and first.error is not None:
        return f"rank {first.rank} {first.error.phase}: {first.error.type}"
    return f"rank {result.first_failure} {first.ending() if first else 'failed'}"


def _spec_device(result: RunResult) -> str:
    """The device kind the run was launched on (a run that failed before its metrics has it)."""
    spec = result.spec()
    return spec.device_kind if spec is not None else "?"


def _not_applicable(result: RunResult) -> list[str]:
    unjudged = dataclasses.replace(result, judged={})  # what the test's own checks judged stays
    return evaluate(unjudged).not_applicable() if result.ok else []


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "mib":
        return f"{value / 2**20:.1f}"
    if kind == "float":
        return f"{value:.4g}"
    return str(value)


def render_table(rows: list[tuple[dict, str, str]]) -> list[str]:
    """rows: (summary row, test outcome, the test's own first failure line) -> aligned lines."""
    cells = [COLUMNS]
    for row, outcome, why in rows:
        verdict = verdict_cell(row, outcome, why)
        case = row["case"] + (f" [{', '.join(row['overrides'])}]" if row.get("overrides") else "")
        case += f" ({row['engine'].rsplit('.', 1)[-1]})" if row.get("engine") else ""
        cells.append(
            (
                row.get("test") or "-",
                case,
                row["device"],
                str(row["ranks"]),
                _fmt(row["grad_norm"], "float"),
                _fmt(row["loss"], "float"),
                _fmt(row["peak"], "mib"),
                _fmt(row["retained"], "mib"),
                _fmt(row["rs_calls"], "int"),
                row.get("clipped") or "-",
                _fmt(row.get("start_s"), "float"),
                _fmt(row["step_s"], "float"),
                verdict,
                ", ".join(line.partition(":")[0] for line in row.get("not_applicable", ())) or "-",
            )
        )
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(str(c[i]).ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells
    ]
    # why each check could not apply, once for every row it stands for (trainer runs share theirs)
    reasons = sorted({line for row, _, _ in rows for line in row.get("not_applicable", ())})
    return lines + [f"not applicable, {line}" for line in reasons]


def verdict_cell(row: dict, outcome: str, why: str) -> str:
    """What the test made of the run: a run no check judged is "ran, unchecked", never "passed";
    a failed check shows its letter and numbers."""
    judged = row.get("judged", {})
    failed = {letter: detail for letter, (status, detail) in judged.items() if status == FAILED}
    if outcome == "passed":  # a test may expect its run, or a check, to fail
        if not row.get("ok"):
            return f"passed (run failed: {row.get('cause') or '?'})"
        if failed:
            return f"passed (red as the test expects: {', '.join(sorted(failed))})"
        passed = sorted(letter for letter, (status, _) in judged.items() if status == PASSED)
        return f"passed: {' '.join(passed)}" if passed else "ran, unchecked"
    cause = row.get("cause") or "; ".join(failed.values()) or why
    return f"{outcome}: {cause}" if cause else outcome


def read_case_artifacts(folder: Path) -> dict:
    """One case folder -> {'spec': spec.json, 'ranks': [metrics...]}."""
    run = RunFolder(folder)
    ranks = []
    while (path := run.metrics(len(ranks))).is_file():
        metrics = read_json(path)  # a file cut short reads as missing, never a traceback
        ranks.append(metrics if isinstance(metrics, dict) else {})
    return {"spec": read_json(run.spec) or {}, "ranks": ranks}


OUTCOME_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3}


def first_cause(report) -> str:
    """The first `check x:` line of a failed test's report (or its last line), cut short."""
    text = getattr(report, "longreprtext", "") or ""
    found = re.search(r"check [a-z]: [^\n]*", text)
    line = found.group(0) if found else (text.strip().splitlines() or [""])[-1]
    return line[:60]


def run_rows(stats: dict[str, list]) -> list[tuple[dict, str, str]]:
    """One row per run of each test (a test may run several cases), with the test's worst outcome
    over setup, call and teardown: a run that passed and then errored in teardown is one "error"."""
    runs: dict[tuple[str, int], dict] = {}
    worst: dict[str, str] = {}
    why: dict[str, str] = {}  # a failed test's first check message, in a few words
    for outcome in OUTCOME_RANK:
        for report in stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if OUTCOME_RANK[outcome] > OUTCOME_RANK.get(worst.get(nodeid, "passed"), 0):
                worst[nodeid] = outcome
                why[nodeid] = first_cause(report) if outcome in ("failed", "error") else ""
            summaries = [
                v for n, v in getattr(report, "user_properties", ()) if n == SUMMARY_PROPERTY
            ]
            for index, value in enumerate(summaries):
                runs.setdefault((nodeid, index), json.loads(value))
    return [
        (row, worst.get(nodeid, "passed"), why.get(nodeid, "")) for (nodeid, _), row in runs.items()
    ]
