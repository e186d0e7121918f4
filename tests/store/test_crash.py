"""Crash safety: a pass killed with SIGKILL at each step of the write leaves the previous
snapshot complete and readable, and a rerun succeeds. The test runs the pass (a pure
function of the snapshot); the child process it kills takes the lock, loads the snapshot and
commits that result."""

import subprocess
import sys

import pytest

from consolidate.store import Store
from tests.helpers import REPO, crash_pass_result, make_records, random_rows

CHILD = """
import pickle
import sys
from consolidate.store import Store
version, deltas, records, events = pickle.loads(open(sys.argv[2], "rb").read())
s = Store(sys.argv[1])
with s.lock():
    snap = s.load()
    assert (snap.version, snap.deltas) == (version, deltas), "a result of another snapshot"
    s.commit(records, events, base=snap)
print("committed", flush=True)
"""

POINTS = [
    "snapshot:before_rename",
    "after_snapshot",
    "changelog:before_rename",
    "after_changelog",
    "pointer:before_rename",
    "after_pointer",
]


def run_child(root, crash_at=None):
    """The commit of the pass over the store at ``root`` in a child process (killed at
    ``crash_at``)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if crash_at:
        env["CONSOLIDATE_CRASH_AT"] = crash_at
    result = crash_pass_result(Store(root), root.parent / "pass.pkl")
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(result)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_sigkill_during_commit(tmp_path, point):
    root = tmp_path / "s"
    store = Store(root)
    store.create(make_records(random_rows(300, 16, seed=2, namespaces=2, dup_frac=0.4)))
    store.append(
        [
            {
                "id": "pending",
                "namespace": "ns0",
                "text": "written before the pass",
                "vector": [1.0] + [0.0] * 15,
                "last_used": 999.0,
            }
        ]
    )
    before = store.load()
    p = run_child(root, point)
    assert p.returncode == -9, p.stderr
    after = store.load()  # must be readable
    if point == "after_pointer":
        assert after.version == 2 and after.deltas == ()
    else:
        assert after.version == 1
        assert after.records.meta.equals(before.records.meta)
        assert after.deltas == before.deltas
    ids = set(after.records.meta["id"])
    assert "pending" in ids and set(before.records.meta["id"]) <= ids
    p = run_child(root)
    assert p.returncode == 0 and "committed" in p.stdout, p.stderr
    final = store.load()
    assert final.version == after.version + 1 and "pending" in set(final.records.meta["id"])
    # no temp files survive a successful commit
    assert not [f for f in root.rglob(".*tmp-*")]
