"""Two runs' artifacts side by side (say a cuda run and an npu run), with a verdict per metric."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.checks.goldens import GOLDEN_KEYS, relative_tolerance, within
from pytest_fsdp_turbo.report import read_case_artifacts
from pytest_fsdp_turbo_contract.artifacts import RunFolder, read_json
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.records import Reading
from pytest_fsdp_turbo_contract.vocab import GoldenTier

# shown side by side, never judged: they move with the machine
INFORMATIONAL = (
    Reading(lambda m: m.perf.peak_memory_bytes).key,
    Reading(lambda m: m.perf.step_time_s).key,
)
# what the sync policy decides: exact between two runs that declare the same policy on as many
# ranks (a held gradient or a reduce-scatter more is a real difference), shown only otherwise
SYNC_BOUND = (
    Reading(lambda m: m.train.retained_grad_bytes).key,
    Reading(lambda m: m.train.reduce_scatter_calls).key,
)
COMPARED_KEYS = (*GOLDEN_KEYS, *SYNC_BOUND, *INFORMATIONAL)


@dataclass
class Row:
    case_id: str
    metric: str
    a: float | None
    b: float | None
    verdict: str


def _case_id(folder: Path) -> str:
    spec = read_json(RunFolder(folder).spec)
    if not isinstance(spec, dict) or not isinstance(spec.get("case_id"), str):
        raise ConfigError(
            f"compare: {RunFolder(folder).spec}: expected the run's spec as a JSON object with a "
            "case_id (written by the run); it is unreadable or has none"
        )
    return spec["case_id"]


def _case_folders(root: Path) -> dict[str, tuple[str, Path]]:
    """{folder name: (case id, folder)}: a run folder holds one folder per test and call (named
    by the test's node id, the same on every machine); a case folder alone is a run of one case."""
    if not root.is_dir():
        raise ConfigError(f"compare: {root} is not a folder of run artifacts")
    folders = (
        [root]
        if RunFolder(root).spec.is_file()
        else sorted(p for p in root.iterdir() if RunFolder(p).spec.is_file())
    )
    if not folders:
        raise ConfigError(f"compare: {root} holds no case artifacts (no spec.json found)")
    return {folder.name: (_case_id(folder), folder) for folder in folders}


def pair_runs(a: Path, b: Path) -> dict[str, tuple[Path | None, Path | None]]:
    """Label -> (A's folder, B's folder). Folders pair by name (test and case, as both machines
    name them); what is left pairs by case id when the id is in one folder on each side. Two
    single case folders compare as given. Only a case left in several unpaired folders on a side
    is ambiguous, and refused naming them."""
    left, right = _case_folders(a), _case_folders(b)
    if len(left) == len(right) == 1:
        (ida, fa), (idb, fb) = next(iter(left.values())), next(iter(right.values()))
        return {ida if ida == idb else f"{ida} vs {idb}": (fa, fb)}
    pairs: dict[str, tuple[Path | None, Path | None]] = {}
    for name in sorted(set(left) & set(right)):
        pairs[name] = (left[name][1], right[name][1])
    rest_a = {n: v for n, v in left.items() if n not in right}
    rest_b = {n: v for n, v in right.items() if n not in left}
    for case_id in sorted({i for i, _ in rest_a.values()} | {i for i, _ in rest_b.values()}):
        in_a = [f for i, f in rest_a.values() if i == case_id]
        in_b = [f for i, f in rest_b.values() if i == case_id]
        if len(in_a) > 1 and in_b or len(in_b) > 1 and in_a:
            root, same = (a, in_a) if len(in_a) > 1 else (b, in_b)
            raise ConfigError(
                f"compare: {root} holds case {case_id} in {len(same)} folders that match none "
                f"on the other side ({', '.join(p.name for p in same)}); name one of them"
            )
        if in_a and in_b:
            label = case_id if case_id not in pairs else f"{case_id} ({in_a[0].name})"
            pairs[label] = (in_a[0], in_b[0])
        else:
            for folder in in_a or in_b:
                pairs[folder.name] = (folder, None) if in_a else (None, folder)
    return pairs


NOT_A_NUMBER = "not a number"  # a verdict: a compared metric that holds no number


def compare_runs(a: Path, b: Path) -> tuple[list[Row], str, str]:
    rows: list[Row] = []
    label_a = label_b = "?"
    for label, (fa, fb) in pair_runs(a, b).items():
        if fa is None or fb is None:
            rows.append(Row(label, "(case)", None, None, f"only in {'A' if fa else 'B'}"))
            continue
        ra, rb = read_case_artifacts(fa), read_case_artifacts(fb)
        label_a = ra["spec"].get("device_kind", "A")
        label_b = rb["spec"].get("device_kind", "B")
        tier = ra["spec"].get("golden_tier", GoldenTier.RELATIVE)
        tier = GoldenTier.RELATIVE if tier == GoldenTier.NONE else tier
        # the golden's own tolerance for the dtype the run declared (bf16's rounding, say)
        relative = max(relative_tolerance(_declared_dtype(r["spec"])) for r in (ra, rb))
        same_sync = _sync_layout(ra["spec"]) == _sync_layout(rb["spec"])
        ma = ra["ranks"][0] if ra["ranks"] else {}
        mb = rb["ranks"][0] if rb["ranks"] else {}
        if not (ma or mb):  # both runs ended before any rank's readings
            rows.append(Row(label, "(case)", None, None, "no readings on either side"))
            continue
        for key in COMPARED_KEYS:
            va, vb = ma.get(key), mb.get(key)
            if va is None and vb is None:
                continue  # neither run measures it (a trainer run has no memory reading, say)
            if va is None or vb is None:
                verdict = "missing"
            elif key in INFORMATIONAL or (key in SYNC_BOUND and not same_sync):
                verdict = "info"
            elif not (_number(va) and _number(vb)):  # a metrics file edited by hand, say
                verdict = NOT_A_NUMBER
            elif key in SYNC_BOUND:
                verdict = "match" if va == vb else "differs (exact: the same sync policy)"
            else:
                close = within(tier, float(va), float(vb), relative)
                verdict = "match" if close else f"differs ({tier})"
            rows.append(Row(label, key, va, vb, verdict))
    return rows, label_a, label_b


def _declared_dtype(spec: dict) -> str:
    engine = spec.get("engine")
    return str(
        spec.get("golden_dtype") or (engine.get("dtype", "") if isinstance(engine, dict) else "")
    )


def _sync_layout(spec: dict) -> tuple:
    """What the sync-bound readings follow: the declared policy, the ranks and the dtype (held
    gradient bytes scale with it)."""
    engine = spec.get("engine") if isinstance(spec.get("engine"), dict) else {}
    return engine.get("gradient_sync"), engine.get("world_size"), _declared_dtype(spec)


def differing(rows: list[Row]) -> list[Row]:
    """What --fail-on-diff fails on: a difference beyond the tier, a case on one side only, a
    compared metric that holds no number."""
    return [r for r in rows if r.verdict.startswith(("differs", "only in", NOT_A_NUMBER))]


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _timeline_rows(timeline: Path) -> list[dict]:
    """timeline.json's rows, each {rank, phase, start, end} with numbers where numbers go; one
    line naming the file and the row otherwise (a file edited or cut short)."""
    try:
        rows = json.loads(timeline.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"compare --timeline: {timeline}: not readable JSON ({exc})") from None
    expected = "a list of {rank, phase, start, end} (a whole rank, a phase name, two numbers)"
    if not isinstance(rows, list):
        raise ConfigError(f"compare --timeline: {timeline}: expected {expected}")
    for number, row in enumerate(rows):
        fine = (
            isinstance(row, dict)
            and isinstance(row.get("rank"), int)
            and isinstance(row.get("phase"), str)
            and _number(row.get("start"))
            and _number(row.get("end"))
        )
        if not fine:
            raise ConfigError(
                f"compare --timeline: {timeline}: row {number}: expected {expected}; got {row!r}"
            )
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    return str(value)


def render(rows: list[Row], label_a: str, label_b: str) -> list[str]:
    cells = [("case", "metric", f"A ({label_a})", f"B ({label_b})", "verdict")]
    cells += [(r.case_id, r.metric, _fmt(r.a), _fmt(r.b), r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return ["  ".join(c[i].ljust(widths[i]) for i in range(5)).rstrip() for c in cells]


def _pyplot():
    try:
        import matplotlib  # optional: the plot extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plot extra
    except ImportError:
        raise ConfigError(
            "compare --png: matplotlib is not installed (pip install 'pytest-fsdp-turbo[plot]')"
        ) from None
    return plt


def write_timeline_png(runs: list[tuple[str, Path]], path: Path) -> None:
    """Per-rank phase timelines (from each case folder's timeline.json), one panel per case and
    run, so a slow case shows where its time went."""

    panels = []
    for label, root in runs:
        for case_id, (_, folder) in sorted(_case_folders(root).items()):
            timeline = RunFolder(folder).timeline
            if not timeline.is_file():
                raise ConfigError(f"compare --timeline: {timeline} does not exist")
            panels.append((f"{label}: {case_id}", _timeline_rows(timeline)))
    plt = _pyplot()
    phases = sorted({row["phase"] for _, rows in panels for row in rows})
    colours = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(phases)}
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(
            9,
            1.2 + 0.5 * sum(1 + max((r["rank"] for r in rows), default=0) for _, rows in panels),
        ),
        squeeze=False,
    )
    for ax, (title, rows) in zip(axes[:, 0], panels):
        start = min((r["start"] for r in rows), default=0.0)
        for row in rows:
            ax.broken_barh(
                [(row["start"] - start, row["end"] - row["start"])],
                (row["rank"] - 0.4, 0.8),
                color=colours[row["phase"]],
            )
        ax.set_yticks(sorted({r["rank"] for r in rows}))
        ax.set_ylabel("rank")
        ax.set_title(title, fontsize="small")
    axes[-1, 0].set_xlabel("seconds since the first rank started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[p]) for p in phases]
    fig.legend(handles, phases, loc="upper right", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_png(rows: list[Row], label_a: str, label_b: str, path: Path) -> None:
    """Each metric as B relative to A, one bar group per case: 1.0 means identical."""
    plt = _pyplot()
    numeric = [
        r for r in rows if isinstance(r.a, int | float) and isinstance(r.b, int | float) and r.a
    ]
    metrics = sorted({r.metric for r in numeric})
    cases = sorted({r.case_id for r in numeric})
    fig, ax = plt.subplots(figsize=(max(6, len(metrics) * 0.9), 4.5))
    width = 0.8 / max(1, len(cases))
    for i, case_id in enumerate(cases):
        values = {r.metric: float(r.b) / float(r.a) for r in numeric if r.case_id == case_id}  # type: ignore[arg-type]
        xs = [m + i * width for m in range(len(metrics))]
        ax.bar(xs, [values.get(m, float("nan")) for m in metrics], width, label=case_id)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [m + 0.4 - width / 2 for m in range(len(metrics))], metrics, rotation=60, ha="right"
    )
    ax.set_ylabel(f"{label_b} / {label_a}")
    ax.set_title(f"pytest-fsdp-turbo compare: {label_b} relative to {label_a}")
    if cases:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
