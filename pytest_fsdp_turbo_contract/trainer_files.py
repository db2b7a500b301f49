"""A verl trainer run's folder: `TrainerFolder` is the one owner of its file names (the plugin writes
the spec and reads the rest; the trainer entry and the observer write them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainerFolder:
    path: Path

    @property
    def spec(self) -> Path:  # the TrainerSpec
        return self.path / "trainer_spec.json"

    @property
    def log(self) -> Path:  # main_ppo's own output: the driver, and Ray's echo of every actor
        return self.path / "trainer.log"

    @property
    def actor_logs(self) -> Path:  # each Ray worker's own stdout and stderr, copied after the run
        return self.path / "actors"

    @property
    def hydra(self) -> Path:  # Hydra's output folder (hydra.run.dir)
        return self.path / "hydra"

    @property
    def resolved_config(self) -> Path:  # the config verl composed, as Hydra saved it
        return self.hydra / ".hydra" / "config.yaml"

    @property
    def data(self) -> Path:  # the tiny cases' parquet files
        return self.path / "data"

    @property
    def observe(self) -> Path:
        return self.path / "observe"

    @property
    def rank(self) -> Callable[[int], Path]:
        return lambda rank: self.observe / f"rank{rank}.json"

    @property
    def replica(self) -> Callable[[int], Path]:
        return lambda pid: self.observe / f"replica-{pid}.json"

    @property
    def capture(self) -> Callable[[int], Path]:  # what the reference replays of step N (from 0)
        return lambda step: self.observe / "capture" / f"step-{step}"

    @property
    def step_metrics_of(self) -> Callable[[int, int], Path]:
        """(step, rank) -> the harness's reading of optimizer step N >= 1 (step 0's is the run
        folder's rankN.metrics.json, as every case's), for the checks that judge every step."""
        return lambda step, rank: self.path / "steps" / f"step-{step}" / f"rank{rank}.metrics.json"

    def stepped_count(self) -> int:
        """Optimizer steps whose readings were written (step 0 counted where any step is)."""
        later = list((self.path / "steps").glob("step-*"))
        return 1 + max((int(p.name.removeprefix("step-")) for p in later), default=0)

    @property
    def replay(self) -> Path:  # the reference's verdict material, every step
        return self.observe / "replay.json"

    def captured_steps(self) -> list[Path]:
        found = self.observe.glob("capture/step-*")
        return sorted(found, key=lambda path: int(path.name.removeprefix("step-")))

    @property
    def step_metrics(self) -> Path:  # verl's own step metrics, as its tracking logger got them
        return self.observe / "step-metrics.json"

    @property
    def metrics(self) -> Path:  # the harness's reading of the run, for goldens and compare
        return self.path / "metrics.json"

    def ranks(self) -> list[Path]:
        return sorted(self.observe.glob("rank*.json"))

    def replicas(self) -> list[Path]:
        return sorted(self.observe.glob("replica-*.json"))
