"""STAND-IN fsdp_turbo (tests only): see ../../fsdp_turbo_standin_core.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
