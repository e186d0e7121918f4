"""The console scripts end to end, as a user runs them (subprocess, real embedding model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from consolidate.store.lance import open_store_dir
from tests.helpers import LOCOMO, REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not LOCOMO.exists(), reason="LOCOMO data not present"),
]
BIN = Path(sys.executable).parent


def run(cmd, tmp_path, *args):
    env = {**os.environ, "CONSOLIDATE_DATA_DIR": str(LOCOMO.parents[1])}
    p = subprocess.run(
        [str(BIN / cmd), *args, f"hydra.run.dir={tmp_path}/run-{len(args)}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_consolidate_trigger_undo(tmp_path):
    store_dir = tmp_path / "store"
    out = run("consolidate", tmp_path, "debug=default", f"store.dir={store_dir}")
    assert (
        "imported" in out
        and "records out" in out
        and out.strip().splitlines()[-1].startswith("wall time")
    )
    summary = json.loads(next(tmp_path.glob("run-*/summary.json")).read_text())
    st = summary["stats"]
    n_obs = summary["import"]["observations"]
    assert n_obs > 300 and st["records_in"] == n_obs
    # every record is accounted for: live + merged members + dropped
    assert (
        st["records_out"]
        + st["merged_members"]
        - st["merges"]
        - st["exact_merges"]
        + st["dropped_floor"]
        + st["dropped_cap"]
        == n_obs
    )
    v = summary["commit"]["version"]
    assert st["model_calls"] == 0 and v == summary["base_version"] + 1
    assert (
        summary["commit"]["rows_written"]
        == st["records_out"] + st["merged_members"] + st["dropped_floor"] + st["dropped_cap"]
    )  # the first pass stamps every kept row
    snap = open_store_dir(store_dir).load()
    assert int(snap.records.live_mask().sum()) == st["records_out"]
    # nothing new: the trigger does not fire
    out = run("consolidate", tmp_path, "debug=default", f"store.dir={store_dir}", "sleep.cap=5")
    assert "not fired" in out and "skipped" in out
    assert open_store_dir(store_dir).head().version == v
    # undo one merge from the changelog, by a prefix of its id
    log = store_dir / "changelogs" / summary["commit"]["changelog"]
    merge = next(json.loads(x) for x in log.read_text().splitlines() if '"op": "merge"' in x)
    out = run(
        "consolidate-undo",
        tmp_path,
        "debug=default",
        f"store.dir={store_dir}",
        f"id={merge['id'][:12]}",
    )
    assert f"restored {len(merge['members'])} records" in out
    m = open_store_dir(store_dir).load().records.meta.set_index("id")
    assert m.loc[merge["members"], "deleted_at"].isna().all()
    assert m.loc[merge["id"], "deleted_reason"] == "undone"
    # a second undo does nothing and says so (exit 0, nothing written); an id that names
    # nothing is a one-line error, exit status 2
    out = run(
        "consolidate-undo", tmp_path, "debug=default", f"store.dir={store_dir}",
        f"merge_id={merge['id']}",
    )  # fmt: skip
    assert f"undone before, nothing done: 1 unit(s) ({merge['id']})" in out
    assert open_store_dir(store_dir).head().version == v + 1
    p = subprocess.run(
        [
            str(BIN / "consolidate-undo"),
            "debug=default",
            f"store.dir={store_dir}",
            "id=zzzz",
            f"hydra.run.dir={tmp_path}/undo3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        p.returncode == 2
        and "error: no applied plan, merge or drop has an id starting with" in (p.stderr)
    )
    assert "Traceback" not in p.stderr and open_store_dir(store_dir).head().version == v + 1


def test_dry_run_and_bad_override(tmp_path):
    store_dir = tmp_path / "store"
    run("consolidate", tmp_path, "debug=default", f"store.dir={store_dir}", "sleep.dry_run=true")
    summary = json.loads(next(tmp_path.glob("run-*/summary.json")).read_text())
    assert open_store_dir(store_dir).head().version == summary["base_version"]
    assert list((store_dir / "changelogs").glob("dry-run-*.jsonl"))
    p = subprocess.run(
        [str(BIN / "consolidate"), "sleep.treshold=0.5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "treshold" in p.stderr


@pytest.mark.parametrize(
    "args,expect",
    [
        (["similarity.device=cuda"], "CUDA is not available"),
        (["similarity.engine=triton", "similarity.device=cpu"], "TRITON_INTERPRET"),
        (["similarity.engine=nope"], "engine must be one of"),
        (["merge=vllm"], "setup_vllm.sh"),
        (["source=mem0"], "source.mem0.vector_store.config.path has no value"),
        (["source=pgvector"], "source=pgvector needs source.dsn=... and source.table=..."),
        (
            ["source=pgvector", "source.dsn='postgresql://nobody@127.0.0.1:1/x'", "source.table=m"],
            "cannot connect to the database of table m",
        ),
    ],
)
def test_settings_errors_are_one_line_and_build_nothing(tmp_path, args, expect):
    if "merge=vllm" in args and __import__("importlib").util.find_spec("vllm"):
        pytest.skip("vllm is installed here")
    if "similarity.device=cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here")
    store_dir = tmp_path / "store"
    p = subprocess.run(
        [
            str(BIN / "consolidate"),
            "debug=default",
            f"store.dir={store_dir}",
            *args,
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith("error:") and expect in p.stderr
    assert "Traceback" not in p.stderr
    assert not store_dir.exists()  # failed before the store was built
