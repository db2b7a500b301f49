"""pytest-fsdp-turbo: hardware-aware pytest plugin and e2e harness for FSDP2 / FSDP-Turbo training.

Importing this package never imports torch; the rank-side code lives in `pytest_fsdp_turbo_engine`.
"""

__version__ = "0.1.0"
