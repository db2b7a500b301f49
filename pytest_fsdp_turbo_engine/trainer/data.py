"""The tiny trainer cases' data: the harness's prompt set as the parquet files verl's trainer reads
(chat-style prompt, the target as `reward_model.ground_truth`, a data source), built locally."""

from __future__ import annotations

import json
from pathlib import Path

from pytest_fsdp_turbo_fixtures import DATA_DIR

PROMPTS = DATA_DIR / "prompts" / "nearest_char.jsonl"
DATA_SOURCE = "pytest_fsdp_turbo/nearest_char"


def write_parquet(folder: Path, rows: int = 16) -> Path:
    """train.parquet and val.parquet in `folder` (the same rows: the run never validates)."""
    import pandas as pd

    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    records = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p["prompt"]}],
            "ability": "echo",
            "reward_model": {"style": "rule", "ground_truth": p["target"]},
            "extra_info": {"index": i, "split": "train"},
        }
        for i, p in enumerate((prompts * (rows // len(prompts) + 1))[:rows])
    ]
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(records)
    for name in ("train", "val"):
        frame.to_parquet(folder / f"{name}.parquet")
    return folder
