#!/usr/bin/env bash
# Run the e2e suite for the detected hardware (or the kind given: cpu | gpu | npu), strictly.
set -euo pipefail
kind="${1:-}"
if [ -z "$kind" ]; then
  kind=$(pytest-fsdp-turbo doctor | sed -n 's/^devices: *\([a-z]*\):.*/\1/p')
  [ "$kind" = "cuda" ] && kind=gpu
fi
case "$kind" in
  cpu|gpu|npu) ;;
  *) echo "run_suite.sh: expected cpu, gpu or npu; got '$kind'" >&2; exit 2 ;;
esac
shift || true
exec pytest e2e -m "${kind}_e2e" --fsdp-turbo-strict "$@"
