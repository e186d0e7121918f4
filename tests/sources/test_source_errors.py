"""A source or store that is not what the user meant is one ``error:`` line and exit status
2, before any model loads and with nothing written: a mistyped ``store.dir`` (naming the
closest existing store), an empty or missing memory file, namespaces that match nothing, a
Mem0 Qdrant folder that is missing or open in another process, a Mem0 namespace key no
memory has. ``source.allow_empty=true`` runs on a source that reads as empty."""

import json
import subprocess
import sys

import pytest

from tests.helpers import make_records, random_rows, run_job, tree_digest


def job(tmp_path, *args, module="consolidate"):
    return run_job(tmp_path, *args, module=module)


def one_error(r, want):
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and want in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "Loading weights" not in r.stderr  # refused before any model loaded
    return errors[0]


def test_a_mistyped_store_dir_names_the_closest_store_and_builds_nothing(tmp_path):
    from consolidate.store.lance import LanceStore

    LanceStore(tmp_path / "stores" / "alice").create(make_records(random_rows(5, 8)))
    before = tree_digest(tmp_path / "stores")
    line = one_error(
        job(tmp_path, f"store.dir={tmp_path}/stores/alicee"),
        f"no store at {tmp_path}/stores/alicee (the closest existing store: "
        f"{tmp_path}/stores/alice): store.create=true builds a new one there",
    )
    assert "from locomo" in line
    assert not (tmp_path / "stores" / "alicee").exists()
    assert tree_digest(tmp_path / "stores") == before


def test_an_empty_or_missing_memory_file(tmp_path):
    (tmp_path / "m.jsonl").write_text("")
    one_error(job(tmp_path, "source=jsonl", "source.path=m.jsonl"), "m.jsonl: no memories")
    one_error(
        job(tmp_path, "source=jsonl", "source.path=missing.jsonl"),
        "memory file not found: missing.jsonl",
    )


def test_namespaces_that_match_nothing_unless_allowed(tmp_path):
    from consolidate.store.lance import LanceStore

    s = LanceStore(tmp_path / "s")
    s.create(make_records(random_rows(6, 8, namespaces=2)))
    s.export(tmp_path / "m.jsonl")
    before = (tmp_path / "m.jsonl").read_bytes()
    args = ["source=jsonl", "source.path=m.jsonl", "source.namespaces=[nobody]"]
    one_error(
        job(tmp_path, *args),
        "file m.jsonl holds no memories in namespaces ['nobody']: check the source's settings",
    )
    r = job(tmp_path, *args, "source.allow_empty=true", "source.apply=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["records_read"] == 0
    assert (tmp_path / "m.jsonl").read_bytes() == before


@pytest.fixture
def mem0_store(tmp_path, monkeypatch):
    """A Mem0 store on a local Qdrant folder (``mem0/qdrant``) with 3 memories of user
    ``ben``; returns the job's overrides for it."""
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.setenv("MEM0_TELEMETRY", "False")
    pytest.importorskip("mem0")
    from mem0 import Memory

    from consolidate.embed import packaged_model_path

    cfg = {
        "vector_store": {
            "provider": "qdrant",
            "config": {
                "path": str(tmp_path / "mem0" / "qdrant"),
                "collection_name": "mem0",
                "embedding_model_dims": 384,
                "on_disk": True,
            },
        },
        "embedder": {"provider": "huggingface", "config": {"model": str(packaged_model_path())}},
        "history_db_path": str(tmp_path / "mem0" / "history.db"),
    }
    m = Memory.from_config(cfg)
    for t in ("Ben runs.", "Ben swims.", "Ben cycles."):
        m.add(t, user_id="ben", infer=False)
    m.vector_store.client.close()
    del m
    return cfg, [
        "source=mem0",
        f"source.mem0.vector_store.config.path={tmp_path}/mem0/qdrant",
        f"source.mem0.embedder.config.model={packaged_model_path()}",
        f"source.mem0.history_db_path={tmp_path}/mem0/history.db",
    ]


@pytest.mark.slow
def test_mem0_folder_missing_locked_or_keyed_otherwise(tmp_path, mem0_store):
    cfg, over = mem0_store
    typo = [o.replace("mem0/qdrant", "mem0/qdrnt") for o in over]
    one_error(job(tmp_path, *typo), f"no Qdrant folder at {tmp_path}/mem0/qdrnt")
    assert not (tmp_path / "mem0" / "qdrnt").exists()
    one_error(
        job(tmp_path, *over, "source.namespace_key=agent_id"),
        "none of the 3 memories of the Mem0 store has the namespace key 'agent_id' "
        "(source.namespace_key); they have ['user_id']",
    )
    holder = subprocess.Popen(  # an agent's Memory holds the folder
        [
            sys.executable,
            "-c",
            "import sys, time; from qdrant_client import QdrantClient; "
            "c = QdrantClient(path=sys.argv[1]); print('open', flush=True); time.sleep(120)",
            str(tmp_path / "mem0" / "qdrant"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        one_error(
            job(tmp_path, *over, "sleep.force=true"),
            f"the Qdrant folder {tmp_path}/mem0/qdrant is open in another process",
        )
        one_error(
            job(tmp_path, *over, "id=last", module="undo"),
            f"the Qdrant folder {tmp_path}/mem0/qdrant is open in another process",
        )
    finally:
        holder.kill()
        holder.wait()
    r = job(tmp_path, *over, "sleep.force=true")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["records_read"] == 3
