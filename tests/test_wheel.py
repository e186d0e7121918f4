"""A normal (non-editable) install runs the jobs: the wheel carries its configs.

Builds the wheel from this checkout, installs it (no dependencies, no index) into a fresh
virtual environment whose third-party packages come from the test environment's
site-packages by a path entry (so the editable install of this checkout is not on the path),
and runs the main job on the debug preset from an unrelated directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import DATA_DIR, LOCOMO, REPO

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not LOCOMO.exists(), reason="LOCOMO data not found")
def test_wheel_runs_the_main_job_from_an_unrelated_directory(tmp_path):
    # build from a copy of the checkout's files (a build writes build/ and egg-info beside them)
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for f in filter(None, files):
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(src)],
        check=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    (wheel,) = dist.glob("consolidate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ("consolidate/conf/consolidate.yaml", "consolidate/conf/sleep/default.yaml",
                 "consolidate/conf/hydra/default.yaml", "consolidate/py.typed",
                 "consolidate/evaluation/longmemeval_tiny.json"):  # fmt: skip
        assert want in names, want
    assert not any(n.startswith(("tests/", "scripts/", "eval/")) for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=600,
    )  # fmt: skip
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # the dependencies: the test environment's site-packages as a plain path entry (its
    # .pth files, the editable finder of this checkout among them, are not run from there)
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = tmp_path / "elsewhere"
    where.mkdir()
    env = {**os.environ, "CONSOLIDATE_DATA_DIR": str(DATA_DIR), "PYTHONPATH": ""}
    env.pop("CONSOLIDATE_ROOT", None)
    found = subprocess.run(
        [str(py), "-c", "import consolidate, sys; print(consolidate.__file__)"],
        check=True, capture_output=True, text=True, cwd=where, env=env,
    ).stdout.strip()  # fmt: skip
    assert found.startswith(site), found  # the installed wheel, not this checkout

    r = subprocess.run(
        [str(env_dir / "bin" / "consolidate"), "debug=default", "sleep.force=true"],
        cwd=where, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (summary_file,) = where.glob("outputs/consolidate/*/summary.json")
    summary = json.loads(summary_file.read_text())
    store = where / "stores" / "locomo-debug"
    assert (store / "CURRENT").exists()
    report = json.loads((store / "import_report.json").read_text())
    assert summary["import"]["conversations"] == report["conversations"] == 2
    assert summary["records_read"] == report["observations"] > 0
    assert summary["ran"] is True
