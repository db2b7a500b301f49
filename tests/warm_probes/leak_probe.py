"""Imported by a later case's ranks: fails the rank if anything an earlier case did is visible."""

import os
import sys

from pytest_fsdp_turbo_engine.engines import registry

leaks = []
if "PYTEST_FSDP_TURBO_POLLUTED" in os.environ:
    leaks.append("environment variable PYTEST_FSDP_TURBO_POLLUTED")
if "polluter" in sys.modules or "pytest_fsdp_turbo_polluted_marker" in sys.modules:
    leaks.append("module polluter")
if any(backend == "fsdp_polluted" for _, backend, _, _ in registry.registered()):
    leaks.append("engine fsdp_polluted in the registry")
if leaks:
    raise RuntimeError("state leaked from an earlier case: " + ", ".join(leaks))
