"""``consolidate-reembed``: every vector recomputed by a real second model (MiniLM with a
96-d projection, built in the test), the switch atomic, writers during the run kept, the old
store kept whole and switched back to."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from consolidate.embed import Embedder, packaged_model_path
from consolidate.reembed import reembed_store, switch_stores
from consolidate.store import Store
from consolidate.store.lance import LanceStore, open_store_dir
from tests.helpers import LOCOMO, REPO, make_records, random_rows

D_NEW = 96


@pytest.fixture(scope="module")
def model96(tmp_path_factory):
    """all-MiniLM-L6-v2 followed by a seeded 384 -> 96 projection: another model, offline."""
    import torch
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize
    except ImportError:  # older sentence-transformers
        from sentence_transformers.models import Dense, Normalize

    torch.manual_seed(0)
    base = SentenceTransformer(str(packaged_model_path()), device="cpu")
    m = SentenceTransformer(
        modules=[
            base[0],
            base[1],
            Dense(384, D_NEW, activation_function=torch.nn.Identity()),
            Normalize(),
        ],
        device="cpu",
    )
    path = tmp_path_factory.mktemp("model96") / "minilm-96"
    m.save(str(path))
    return path


@pytest.fixture(scope="module")
def emb96(model96):
    return Embedder(model96, device="cpu", show_progress=False)


def _store(root, fmt, n=40):
    rows = random_rows(n, 384, seed=3, namespaces=2)
    rows[5]["text"] = rows[6]["text"]  # a repeated text: embedded once, stored twice
    recs = make_records(rows)
    recs.meta.loc[7, "deleted_at"] = 1001.0  # a tombstone gets a new vector too
    recs.meta.loc[7, "deleted_reason"] = "floor"
    store = (LanceStore if fmt == "lance" else Store)(root)
    store.create(recs)
    return store


def _reference(emb, texts):
    v = emb.encode(list(texts)).astype(np.float64)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.mark.parametrize("fmt", ["lance", "parquet"])
def test_reembed_switches_to_new_vectors_and_keeps_everything_else(tmp_path, fmt, emb96):
    root = tmp_path / "alice"
    store = _store(root, fmt)
    before = store.load().records
    calls = []

    class Agent:
        """The embedder, while an agent appends a memory and recalls two during the run."""

        def encode(self, texts):
            calls.append(len(texts))
            if len(calls) == 1:
                new = make_records(
                    [
                        {
                            **random_rows(1, 384, seed=9)[0],
                            "id": "late-1",
                            "text": "a memory written during the re-embed",
                        }
                    ]
                )
                store.append(new)
                store.mark_used(["r00001"], now=1002.0)
            return emb96.encode(texts)

    touched_late = []

    def check(recs):  # after the second read: a touch here must reach the new store
        store.mark_used(["r00002"], now=1003.0)
        touched_late.append(True)

    out = reembed_store(root, Agent(), model="minilm-96", check=check)
    assert out["old_dim"] == 384 and out["dim"] == D_NEW and out["format"] == fmt
    assert out["records"] == 41 and out["late_texts"] == 1 and out["late_deltas"] == 1
    assert calls == [39, 1]  # 40 texts, one repeated; then only the appended one
    new = open_store_dir(root).load()
    assert new.dim == D_NEW and isinstance(open_store_dir(root), type(store))
    m = new.records.meta.set_index("id")
    ref = _reference(emb96, m["text"])
    np.testing.assert_allclose(new.records.vectors.astype(np.float64), ref, atol=1e-6)
    # every other column as it was (the tombstone included), the touches applied
    old = before.meta.set_index("id")
    for col in ("text", "namespace", "importance", "created_at", "deleted_at", "source_ids"):
        assert m.loc[old.index, col].equals(old[col]), col
    assert m.loc["r00007", "deleted_reason"] == "floor"
    assert m.loc["r00001", "last_used"] == 1002.0
    assert m.loc["r00001", "strength"] == old.loc["r00001", "strength"] + 1
    assert m.loc["r00002", "strength"] == old.loc["r00002", "strength"] + 1
    assert m.loc["late-1", "text"] == "a memory written during the re-embed"
    # the old store is kept whole: 384-d, its own vectors, the late append too
    kept = open_store_dir(out["backup"]).load()
    assert kept.dim == 384
    k = kept.records.meta["id"].tolist()
    np.testing.assert_array_equal(
        kept.records.vectors[[k.index(i) for i in old.index]], before.vectors
    )
    # switch back: store.dir is the old store again
    back = switch_stores(root, out["backup"])
    assert back["now_dim"] == 384 and open_store_dir(root).load().dim == 384
    assert open_store_dir(out["backup"]).load().dim == D_NEW
    assert not list(tmp_path.glob("alice.reembed-*"))


def test_failed_reembed_leaves_store_as_it_was(tmp_path, emb96):
    root = tmp_path / "bob"
    store = _store(root, "lance")
    head = store.head()

    def check(recs):
        raise RuntimeError("stop before the switch")

    with pytest.raises(RuntimeError, match="stop before"):
        reembed_store(root, emb96, check=check)
    now = open_store_dir(root)
    assert now.head().version == head.version and now.load().dim == 384
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bob"]  # no shadow, no backup

    class Wrong:
        def encode(self, texts):
            return np.zeros((len(texts) - 1, 8), np.float32)

    with pytest.raises(ValueError, match="returned shape"):
        reembed_store(root, Wrong())
    with pytest.raises(FileExistsError):
        reembed_store(root, emb96, backup=root)
    # a backup that a rename cannot reach is refused before anything is written
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reembed_store(root, emb96, backup=tmp_path / "no" / "such" / "bk")
    import os

    if os.stat("/dev/shm").st_dev != tmp_path.stat().st_dev:
        with pytest.raises(ValueError, match="another file system"):
            reembed_store(root, emb96, backup="/dev/shm/consolidate-bk-test")
    assert open_store_dir(root).load().dim == 384
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bob"]


def test_a_symlinked_store_and_a_pass_waiting_for_the_lock(tmp_path, emb96):
    """store.dir given as a symlink: the folder it names is switched (the link still
    leads to the store). A pass that waited for the lock during the re-embed holds the new
    store's lock, not the old one's."""
    import threading

    from consolidate.store import LockTimeoutError

    real = tmp_path / "real"
    _store(real, "lance")
    link = tmp_path / "link"
    link.symlink_to(real)
    waiter = LanceStore(link)
    held = []

    def pass_waiting():
        with waiter.lock(timeout_s=120):
            try:
                LanceStore(real).lock(timeout_s=0).__enter__()
                held.append("the lock it holds is not the store's")
            except LockTimeoutError:
                held.append("ok")

    class Slow:
        def encode(self, texts):
            t = threading.Thread(target=pass_waiting)
            t.start()
            threads.append(t)
            return emb96.encode(texts)

    threads = []
    out = reembed_store(link, Slow())
    threads[0].join(60)
    assert held == ["ok"]
    assert link.is_symlink() and out["store"] == str(real)
    assert open_store_dir(link).load().dim == D_NEW


def test_reembed_waits_for_no_pass(tmp_path, emb96):
    from consolidate.store import LockTimeoutError

    root = tmp_path / "carol"
    store = _store(root, "parquet")
    with store.lock(), pytest.raises(LockTimeoutError):
        reembed_store(root, emb96)


@pytest.mark.slow
@pytest.mark.skipif(not LOCOMO.exists(), reason="data not present")
def test_reembed_job_calibrates_then_switches(tmp_path, model96):
    """The command of docs/store.md: calibration for the new model, the switch, the command back."""
    root = tmp_path / "store"
    _store(root, "lance")
    env = {**os.environ, "CONSOLIDATE_DATA_DIR": str(LOCOMO.parents[1])}
    bin_ = Path(sys.executable).parent / "consolidate-reembed"
    p = subprocess.run(
        [
            str(bin_),
            f"store.dir={root}",
            f"embedder.model_path={model96}",
            "calibration.max_pairs=300",
            "embedder.device=cpu",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    calib = json.loads(Path(s["calibration"]["file"]).read_text())
    assert {e["dataset"] for e in calib["entries"]} == {"stsb-dev", "stsb-test", "sick-all"}
    assert all(e["pairs"] == 300 for e in calib["entries"])
    assert calib["recommended"]["threshold"] == s["calibration"]["threshold"]
    assert f"sleep.calibration_file={s['calibration']['file']}" in p.stdout
    assert open_store_dir(root).load().dim == D_NEW
    back = p.stdout.strip().splitlines()[-1].split("with: ", 1)[1].split()
    assert back[0] == "consolidate-reembed"
    q = subprocess.run(
        [str(bin_), *back[1:], f"hydra.run.dir={tmp_path}/run2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert q.returncode == 0, q.stderr[-3000:]
    assert open_store_dir(root).load().dim == 384
    # a store that is not there: one error line, exit 2, before any model loads
    r = subprocess.run(
        [str(bin_), f"store.dir={tmp_path}/nowhere", f"hydra.run.dir={tmp_path}/run3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error:") and "nowhere" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not LOCOMO.exists(), reason="data not present")
def test_the_docs_example_runs_as_written(tmp_path, model96):
    from tests.helpers import run_readme_example

    _store(tmp_path / "stores" / "alice", "lance")
    p = run_readme_example("reembed", tmp_path, {"NEW_MODEL": str(model96)}, doc="docs/store.md")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "d 384 -> 96" in p.stdout and "sleep.calibration_file=" in p.stdout
    assert open_store_dir(tmp_path / "stores" / "alice").load().dim == D_NEW
    assert len(list((tmp_path / "stores").glob("alice.pre-reembed-*"))) == 1


CRASH_CHILD = """
import sys
from consolidate.embed import Embedder
from consolidate.reembed import reembed_store
from consolidate.store.lance import open_store_dir
root, model = sys.argv[1], sys.argv[2]
store = open_store_dir(root)
reembed_store(root, Embedder(model, device="cpu", show_progress=False),
              check=lambda recs: store.mark_used(["r00003"], now=1004.0))
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["reembed:before_exchange", "reembed:after_exchange"])
def test_sigkill_around_the_exchange_loses_no_touch(tmp_path, model96, point):
    """Killed just before the exchange, store.dir is the old store with every touch;
    just after, the new store with every touch (a touch written during the switch)."""
    root = tmp_path / "s"
    store = _store(root, "lance")
    before = store.load().records.meta.set_index("id").loc["r00003", "strength"]
    env = {**os.environ, "CONSOLIDATE_CRASH_AT": point}
    p = subprocess.run(
        [sys.executable, "-c", CRASH_CHILD, str(root), str(model96)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -9, p.stderr[-2000:]
    now = open_store_dir(root).load()
    assert now.dim == (384 if point == "reembed:before_exchange" else D_NEW)
    assert now.records.meta.set_index("id").loc["r00003", "strength"] == before + 1
    assert len(now.records) == 40
    left = list(tmp_path.glob("s.reembed-*"))  # the other store, named for the user
    assert len(left) == 1 and open_store_dir(left[0]).load().dim == (
        D_NEW if point == "reembed:before_exchange" else 384
    )
