"""A pytest plugin for tests/test_workflow_jobs.py: at the end of a --collect-only session, writes
every collected test's node id and marker names as JSON to the file PYTEST_COLLECTED_MARKERS
names. One collection then serves every CI job's selection."""

import json
import os


def pytest_collection_finish(session):
    out = os.environ["PYTEST_COLLECTED_MARKERS"]
    items = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}
    with open(out, "w") as fh:
        json.dump(items, fh)
