"""Where a case's names point: the prompt set, tiny model specs, an engine module's source; found
without importing anything (the engines run only in the ranks)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

from pytest_fsdp_turbo_fixtures import DATA_DIR

FIXTURES_DIR = DATA_DIR
PROMPT_SET = DATA_DIR / "prompts" / "nearest_char.jsonl"  # the prompts every case samples from


@functools.cache
def prompt_count() -> int:
    return sum(1 for line in PROMPT_SET.read_text().splitlines() if line.strip())


def engine_module_source(module: str, pythonpath: Iterable[str] = ()) -> Path | None:
    """Where a named engine module's source is, as the ranks will look (ppo_run's `pythonpath`
    first, then this process's path), found by walking folders: nothing is imported, not even a
    parent package's `__init__.py` (the engines run only in the ranks); None: nowhere."""
    top, *rest = module.split(".")
    roots = [Path(root or ".") for root in (*pythonpath, *sys.path)]
    try:  # a top-level name is found without importing anything (editable installs' finders too)
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p).parent for p in spec.submodule_search_locations]
    elif spec is not None and spec.origin and not rest:
        roots.append(Path(spec.origin).parent)
    for root in roots:
        folder = root.joinpath(top, *rest[:-1]) if rest else root
        name = rest[-1] if rest else top
        for candidate in (folder / f"{name}.py", folder / name / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def tiny_spec_dirs(extra: Path | None = None, fixtures_dir: Path = FIXTURES_DIR) -> list[Path]:
    """Where tiny model specs are looked up: a downstream's own folder first
    (--fsdp-turbo-tiny-models), then the ones that ship with the plugin."""
    return [*([extra] if extra else []), fixtures_dir / "models"]


def tiny_spec_path(name: str, dirs: list[Path]) -> Path | None:
    return next((d / f"{name}.json" for d in dirs if (d / f"{name}.json").is_file()), None)


def tiny_specs(extra: Path | None = None, fixtures_dir: Path = FIXTURES_DIR) -> list[str]:
    dirs = tiny_spec_dirs(extra, fixtures_dir)
    return sorted({p.stem for d in dirs for p in d.glob("*.json")})
