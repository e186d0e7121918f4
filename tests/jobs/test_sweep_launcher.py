"""Sweeps through Hydra's submitit launcher (its local executor: one process per job, as
on a SLURM cluster with ``hydra/launcher=submitit_slurm``), collected into one table."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.store.lance import LanceStore
from tests.helpers import REPO

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


@pytest.mark.slow
def test_threshold_sweep_on_the_submitit_local_launcher(tmp_path):
    from tests.test_fleet import fleet_records

    recs = fleet_records(n=1000)
    store = LanceStore(tmp_path / "store")
    store.create(recs)
    out = tmp_path / "sweep"
    # both jobs start at once: the second waits for the first's lock (a dry run still
    # takes it), then reads the same, unchanged version
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "consolidate"),
            "-m",
            "hydra/launcher=submitit_local",
            f"store.dir={store.root}",
            "store.init_from=null",
            "sleep.force=true",
            "sleep.dry_run=true",
            "store.lock_timeout_s=300",
            "similarity.device=cpu",
            "sleep.threshold=0.95,0.9",
            f"hydra.sweep.dir={out}",
        ],
        cwd=REPO,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / ".submitit").is_dir()  # the jobs ran through submitit
    t = pd.read_parquet(out / "runs.parquet")
    assert len(t) == 2 and set(t["ran"]) == {True}
    snap = store.load()

    def run(thr):
        return t[t["overrides"].str.contains(rf"sleep\.threshold={thr}(?: |$)")].iloc[0]

    for thr in (0.9, 0.95):
        row = run(thr)
        res = run_pass(
            snap.records,
            cfg=PassConfig(force=True, threshold=thr),
            sim_cfg=SimilarityConfig(device="cpu"),
            version=snap.version + 1,
        )
        assert (row["pairs"], row["merges"], row["records_out"]) == (
            res.stats.pairs,
            res.stats.merges,
            res.stats.records_out,
        )
    assert run(0.9)["pairs"] > run(0.95)["pairs"]
    assert store.head().version == snap.version  # dry runs wrote no version
