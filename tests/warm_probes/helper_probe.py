"""Run by test_warm_ranks as a `python -m` helper: reports where it ran, then exits 3."""

import json
import os
import sys

if __name__ == "__main__":
    report = {"argv": sys.argv[1:], "parent": os.getppid(), "torch_loaded": "torch" in sys.modules}
    print(json.dumps(report))
    print("to stderr", file=sys.stderr)
    raise SystemExit(3)
