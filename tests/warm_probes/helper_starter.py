"""An engine whose ranks each start a helper process that outlives them unless the harness reaps
it: one in a session of its own, left to re-parent (HELPER_PIDS names the file for their pids;
HELPER_THEN_FAIL=1 fails the rank after starting it)."""

import os
import subprocess
import sys

from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.engines.registry import register


@register(backend="fsdp_with_helper", device=["cpu"])
class HelperStartingEngine(FSDPEngineWithLMHead):
    def build(self, model_path: str, *, trainable: bool = True):
        if trainable:
            helper = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)"],
                start_new_session=True,  # its own session and group: out of the rank's tree
            )
            with open(os.environ["HELPER_PIDS"], "a") as out:
                out.write(f"{helper.pid}\n")
            if os.environ.get("HELPER_THEN_FAIL") == "1":
                raise RuntimeError("failing after starting a helper")
        return super().build(model_path, trainable=trainable)
