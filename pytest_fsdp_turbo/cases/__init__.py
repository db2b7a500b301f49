"""The case file, torch-free: one reader for every kind's table (table), the harness's PPO step
(engine_case) and verl's trainer (trainer_case) as kinds of case, and the book that loads them and
makes each case on each device kind a test parameter (book)."""

from pytest_fsdp_turbo.cases.book import (
    DEFAULT_CASES,
    CaseBook,
    CaseParam,
    find_case,
    load_cases,
    read_book,
)
from pytest_fsdp_turbo.cases.engine_case import (
    _FIELDS,
    KINDS,
    OWNER,
    PARTS,
    VERL_NAME,
    Case,
    case_keys,
    validate_case,
    with_overrides,
)
from pytest_fsdp_turbo.cases.lookup import (
    FIXTURES_DIR,
    PROMPT_SET,
    engine_module_source,
    prompt_count,
    tiny_spec_dirs,
    tiny_spec_path,
    tiny_specs,
)
from pytest_fsdp_turbo.cases.table import (
    CASE_ID,
    CASE_ID_MAX,
    MODEL_MAX,
    MODEL_NAME,
    TINY_PREFIX,
    ReadContext,
)
from pytest_fsdp_turbo.cases.trainer_case import TrainerCase, validate_trainer_case

__all__ = [
    "CASE_ID",
    "CASE_ID_MAX",
    "DEFAULT_CASES",
    "FIXTURES_DIR",
    "KINDS",
    "MODEL_MAX",
    "MODEL_NAME",
    "OWNER",
    "PARTS",
    "PROMPT_SET",
    "TINY_PREFIX",
    "VERL_NAME",
    "_FIELDS",
    "Case",
    "CaseBook",
    "CaseParam",
    "TrainerCase",
    "case_keys",
    "engine_module_source",
    "find_case",
    "ReadContext",
    "read_book",
    "load_cases",
    "prompt_count",
    "tiny_spec_dirs",
    "tiny_spec_path",
    "tiny_specs",
    "validate_case",
    "validate_trainer_case",
    "with_overrides",
]
