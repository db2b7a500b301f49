"""verl's own trainer as a case kind: `main_ppo` as a verl e2e script runs it, judged by the harness.
A `[[trainer_case]]` table holds the script's Hydra overrides as the script writes them, the model,
the device kinds and the world size; everything else is the harness's (leases, collective
environment, timeout, logs, the observer, the checks). Its keys are read by the same reader as an
engine case's, from `TrainerCase`'s fields. Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pytest_fsdp_turbo.cases.table import (
    TINY_PREFIX,
    TableReader,
    Where,
    check_known_failure,
    check_tiny,
    golden_reason_of,
    read_rows,
)
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import BOUNDS, Bounds
from pytest_fsdp_turbo_contract.trainer_spec import PLACEHOLDERS, RUN_DIR_VARIABLE
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Env, GoldenTier

TABLE = "trainer_case"
ENTRY = "verl.trainer.main_ppo"
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
# key=value, +key=value, ++key=value or ~key: Hydra's override grammar, as far as a case needs it
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w.\-]*(=.*)?$", re.S)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# where the main_ppo command ends, and the script's own arguments (the case's overrides stand for
# them: the harness runs the script's line, not the script)
SHELL_OPERATORS = ("|", "||", "&&", ";", "&", "|&")
REDIRECT = re.compile(r"^(\d*[<>]|&>)")  # > log, 2>err, &> log, < /dev/null
SCRIPT_ARGS = ("$@", "$*", "${@}", "${*}")
# $NAME or ${NAME}, never Hydra's own ${a.b} or ${oc.env:X}, which Hydra resolves
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
# what the harness sets in every process of a trainer run, which a case's env may not replace
HARNESS_ENV = (
    RUN_DIR_VARIABLE,
    "PYTHONPATH",
    "VERL_USE_EXTERNAL_MODULES",
    Env.CASE_TOKEN,
    "TMPDIR",  # the run's own folder, removed after it
)
# Hydra's own output (its folder, its .hydra copy, its job log): the harness keeps it in the run
# folder (hydra.run.dir, which it sets last, as it does verl's checkpoint folder and step count)
HARNESS_KEYS = ("hydra.",)


@dataclass(frozen=True)
class TrainerCase:
    id: str
    model: str
    # the script's, as its `python -m verl.trainer.main_ppo` line has them
    overrides: tuple[str, ...] = ()
    # trainer.n_gpus_per_node x trainer.nnodes: the devices the harness leases
    world_size: int = field(default=2, metadata={BOUNDS: Bounds(1)})
    devices: tuple[DeviceKind, ...] = (DeviceKind.CPU,)
    # modules verl imports in every process (VERL_USE_EXTERNAL_MODULES): a downstream engine
    # registered in verl's EngineRegistry, for instance
    external_modules: tuple[str, ...] = ()
    # the script's own exports (HCCL_CONNECT_TIMEOUT, ...); the lease's collective environment
    # (device visibility, HCCL port ranges) wins over them
    env: dict[str, str] = field(default_factory=dict)
    # verl's training steps (trainer.total_training_steps), each judged on its own: verl's
    # start-up (Ray, its actors, the rollout servers, the workers its first step starts) is paid
    # once, and a later step costs its own time (docs/performance.md)
    steps: int = field(default=1, metadata={BOUNDS: Bounds(1)})
    # the whole trainer: Ray, every actor, the rollout servers, its steps
    timeout: float = field(
        default=900.0,
        metadata={BOUNDS: Bounds(0, 1e6, low_open=True, expected="a number of seconds > 0")},
    )
    golden_tier: GoldenTier = GoldenTier.RELATIVE
    golden_reason: str = ""  # why the case records no golden: required with golden_tier none
    description: str = ""
    # device kind -> {reason, match}, as an engine case's
    known_failure: dict = field(default_factory=dict)
    # the engine class verl must build for the actor (module.Class, or the class's name): a
    # registration that misses runs verl's own engine, and the run is red
    engine_class: str = ""
    # the single-process reference replays every step (checks b, c, i, l; a against its norm).
    # Default: on for tiny models; a real model's costs a whole fp32 copy of it on one process
    # and every parameter gathered to rank 0 each step (docs/verl.md)
    reference: bool | None = None
    # the micro-batch pair (check h): each mini-batch run again in one pass through the same
    # engine before its step, the gradients held to the k micro-batches'. Default: on for tiny
    # models; a real model's costs one more forward and backward of each mini-batch and one more
    # set of gradient shards (docs/verl.md)
    micro_batch_pair: bool | None = None

    @property
    def is_tiny(self) -> bool:
        return self.model.startswith(TINY_PREFIX)

    @property
    def with_reference(self) -> bool:
        return self.is_tiny if self.reference is None else self.reference

    @property
    def with_micro_batch_pair(self) -> bool:
        return self.is_tiny if self.micro_batch_pair is None else self.micro_batch_pair

    @property
    def rolls_out_with_vllm(self) -> bool:
        return self.override("actor_rollout_ref.rollout.name") in (None, "vllm")

    @property
    def runs_fsdp_turbo(self) -> bool:
        """The actor runs verl's FSDP-Turbo engine: the run needs the library (a checkout)."""
        return self.override("actor_rollout_ref.actor.strategy") == "fsdp_turbo"

    def override(self, key: str) -> str | None:
        """The value the case's overrides give `key` (the last one wins, as in Hydra)."""
        found = None
        for item in self.overrides:
            name, _, value = item.lstrip("+").partition("=")
            if name == key:
                found = value
        return found


READER = TableReader("trainer case", {"case": TrainerCase}, extra=("script", "extends"))


def overrides_of_script(script: Path) -> tuple[str, ...]:
    """The Hydra overrides of the `python -m verl.trainer.main_ppo ...` line of a shell script (a
    verl e2e script), continuation lines joined; `$VAR` and `${VAR}` inside an override are kept
    as written. A word the harness cannot read as overrides is one line, never dropped."""
    try:
        text = script.read_text(encoding="utf-8").replace("\\\n", " ")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{script}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, words in _commands(script, text.splitlines()):
        if ENTRY in words:
            args = words[words.index(ENTRY) + 1 :]
            if any("\n" in word for word in args):
                raise ConfigError(
                    f"{script}: line {number}: an override runs over lines; keep each override "
                    "on its line"
                )
            ends = [i for i, w in enumerate(args) if w in SHELL_OPERATORS or REDIRECT.match(w)]
            args = [w for w in args[: min(ends, default=len(args))] if w not in SCRIPT_ARGS]
            if unread := [w for w in args if w.startswith("$") and "=" not in w]:
                raise ConfigError(
                    f"{script}: {unread[0]!r} after {ENTRY} holds overrides the harness cannot "
                    "read; write them into the case's overrides"
                )
            if stray := [w for w in args if "=" not in w and w[:1] != "~"]:
                raise ConfigError(
                    f"{script}: {stray[0]!r} after {ENTRY} is no Hydra override (key=value or "
                    "~key), and the harness runs the overrides alone; write what it means into "
                    "the case"
                )
            return tuple(args)
    raise ConfigError(f"{script}: no `python -m {ENTRY}` line")


def _commands(script: Path, lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(first line number, shell words) of each command, a quoted string that runs over lines
    (a multi-line echo) read whole; one that never closes is one line naming where it opens."""
    index = 0
    while index < len(lines):
        first, command = index + 1, lines[index]
        index += 1
        while True:
            try:
                words = shlex.split(command, comments=True)
                break
            except ValueError as exc:
                if index == len(lines):
                    raise ConfigError(f"{script}: line {first}: {exc}") from None
                command += "\n" + lines[index]
                index += 1
        yield first, words


def validate_trainer_case(
    raw: dict, path: Path | str, specs: list[str], earlier: dict[str, TrainerCase] | None = None
) -> TrainerCase:
    where = READER.where(raw, path)
    values = dict(raw)
    if not isinstance(values.get("overrides", []), list):  # before extends or script adds to it
        raise where.error(
            "overrides", "a list of Hydra overrides (key=value strings)", values["overrides"]
        )
    if "extends" in values:  # another trainer case's overrides first, then this one's
        if not isinstance(values["extends"], str):
            raise where.error(
                "extends", "the id of one trainer case above this one", raw["extends"]
            )
        base = (earlier or {}).get(values.pop("extends"))
        if base is None:
            raise where.error("extends", "the id of a trainer case above this one", raw["extends"])
        values["overrides"] = [*base.overrides, *values.get("overrides", [])]
        values.setdefault("model", base.model)
    if "script" in values:  # a verl e2e script's own overrides, then the case's
        script = _script(where, Path(path).parent, values.pop("script"))
        values["overrides"] = [*overrides_of_script(script), *values.get("overrides", [])]
    if not isinstance(values.get("overrides"), list | tuple):
        raise where.error(
            "overrides", "a list of Hydra overrides (key=value strings)", values.get("overrides")
        )
    case = TrainerCase(**READER.read(values, where)["case"])
    for item in case.overrides:
        if not _OVERRIDE.match(item):
            raise where.error("overrides", "key=value, +key=value, ++key=value or ~key", item)
        key = item.lstrip("+~").partition("=")[0]
        if key.startswith(HARNESS_KEYS):
            raise where.error(
                "overrides",
                "no override of Hydra's own output (the harness keeps it in the run folder)",
                item,
            )
        for placeholder in _PLACEHOLDER.findall(item):
            if placeholder not in PLACEHOLDERS:
                raise where.error(
                    "overrides", "placeholders among " + ", ".join(PLACEHOLDERS), item
                )
    if not case.devices:
        raise where.error("devices", "at least one of " + ", ".join(DeviceKind), [])
    bad_env = [
        (k, v) for k, v in case.env.items() if not _ENV_NAME.fullmatch(k) or not isinstance(v, str)
    ]
    if bad_env:
        raise where.error("env", "a table of variable = string", dict(bad_env))
    if owned := sorted(set(case.env) & set(HARNESS_ENV)):
        raise where.error("env", "no variable the harness sets in every process", owned[0])
    if bad := [m for m in case.external_modules if not _MODULE.fullmatch(m)]:
        raise where.error("external_modules", "importable module names (a.b.c)", bad[0])
    if case.engine_class and not _MODULE.fullmatch(case.engine_class):
        raise where.error("engine_class", "a class name, or module.Class", case.engine_class)
    check_tiny(where, case.model, specs)
    check_known_failure(where, case.known_failure, case.devices)
    golden_reason_of(where, case.golden_tier, case.golden_reason)
    per_node, nodes = case.override("trainer.n_gpus_per_node"), case.override("trainer.nnodes")
    if per_node is not None or nodes is not None:  # verl's YAML: 8 devices a node, 1 node
        sizes = [_expanded(where, text, case.env) for text in (per_node or "8", nodes or "1")]
        declared = sizes[0] * sizes[1]
        if declared != case.world_size:
            raise where.error(
                "world_size",
                f"trainer.n_gpus_per_node x trainer.nnodes from the overrides ({declared})",
                case.world_size,
            )
    return case


def variable_names(text: str) -> list[str]:
    """The shell variables an override reads, each once, in order."""
    return list(dict.fromkeys(a or b for a, b in VARIABLE.findall(text)))


def variable_value(name: str, env: dict[str, str]) -> str | None:
    """A variable an override reads, as the script's shell would see it: the case's env, then
    this environment (None: set in neither)."""
    return env.get(name, os.environ.get(name))


def _expanded(where: Where, text: str, env: dict[str, str]) -> int:
    """A count as the script's shell would see it: `$VAR` and `${VAR}` from the case's env, then
    this environment; one line naming a variable that is set nowhere or a count that is none."""
    for name in variable_names(text):
        if variable_value(name, env) is None:
            raise where.error(
                "overrides", f"${name} set in the case's env or the environment", text
            )
    value = VARIABLE.sub(lambda m: variable_value(m.group(1) or m.group(2), env) or "", text)
    if not value.strip().isdigit():
        raise where.error("overrides", "a whole number of devices or nodes", text)
    return int(value)


def _script(where: Where, folder: Path, given: object) -> Path:
    """A script inside the case file's folder (or below it), never a path or a link out of it."""
    if not isinstance(given, str) or not given:
        raise where.error("script", "a path to a shell script, relative to the case file", given)
    script = (folder / given).resolve()
    if not script.is_relative_to(folder.resolve()):
        raise where.error("script", "a script inside the case file's folder", given)
    if not script.is_file():
        raise where.error("script", "a shell script next to the case file", str(folder / given))
    return script


def trainer_cases(data: dict, path: Path, specs: list[str]) -> list[TrainerCase]:
    """The case file's `[[trainer_case]]` tables, each validated; ids unique among them."""

    def read_one(row: dict, earlier: list[TrainerCase]) -> TrainerCase:
        return validate_trainer_case(row, path, specs, {c.id: c for c in earlier})

    return read_rows(data, TABLE, READER, path, read_one)
