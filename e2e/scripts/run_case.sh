#!/usr/bin/env bash
# Run one e2e case without writing pytest commands: e2e/scripts/run_case.sh CASE_ID [--device KIND]
set -euo pipefail
exec pytest-fsdp-turbo run "$@"
