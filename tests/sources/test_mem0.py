"""A Mem0 store as source and sink (consolidate.sources.mem0), against a real Mem0 store
built by ``mem0ai`` (Qdrant on a local path, the packaged MiniLM through Mem0's
``huggingface`` embedder, SQLite history; no LLM: ``add(..., infer=False)``): the plan's
merges equal the embedded store's on the same records; applied, a Mem0 user sees the
merged text under the oldest member's id, Mem0's history holds the UPDATE and the DELETEs,
an edited member keeps its cluster unmerged, and undo puts every member back."""

import os
import tempfile

import numpy as np
import pytest

from consolidate.config import PassConfig, SimilarityConfig
from consolidate.pipeline import run_pass
from consolidate.store.lance import LanceStore

# read by mem0 when it is imported: no telemetry, its home folder out of the user's
os.environ["MEM0_TELEMETRY"] = "False"
os.environ.setdefault("MEM0_DIR", tempfile.mkdtemp(prefix="mem0home-"))
from consolidate.sources.mem0 import Mem0Source  # noqa: E402
from tests.helpers import requires  # noqa: E402

# mem0 itself is imported by the fixtures only
pytestmark = [pytest.mark.slow, requires("mem0")]

NOTES = {
    "alice": [
        "Alice moved to Berlin in 2021.",
        "Alice moved to Berlin in 2021!",
        "Alice adopted a cat named Miso.",
        "Alice adopted a cat called Miso.",
        "Alice works as a nurse at the city hospital.",
        "Alice likes hiking.",
    ],
    "bob": [
        "Bob plays the cello in an orchestra.",
        "Bob plays the cello in an orchestra!",
        "Bob is allergic to peanuts.",
        "Bob visited Lisbon last May.",
    ],
}


@pytest.fixture(params=["qdrant", "pgvector"])
def memory(request, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # Mem0 builds its LLM client; never called
    from mem0 import Memory

    from consolidate.embed import packaged_model_path

    if request.param == "qdrant":
        store = {
            "provider": "qdrant",
            "config": {
                "path": str(tmp_path / "qdrant"),
                "collection_name": "mem",
                "embedding_model_dims": 384,
                "on_disk": True,
            },
        }
    else:
        pytest.importorskip("psycopg_pool")
        uri = request.getfixturevalue("pg")
        import psycopg

        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS vector")
            c.execute(f"DROP TABLE IF EXISTS mem_{tmp_path.name[-8:].replace('-', '_')}")
        store = {
            "provider": "pgvector",
            "config": {
                "connection_string": uri,
                "embedding_model_dims": 384,
                "collection_name": f"mem_{tmp_path.name[-8:].replace('-', '_')}",
            },
        }
    m = Memory.from_config(
        {
            "vector_store": store,
            "embedder": {
                "provider": "huggingface",
                "config": {"model": str(packaged_model_path())},
            },
            "history_db_path": str(tmp_path / "history.db"),
        }
    )
    for user, notes in NOTES.items():
        for text in notes:
            m.add(text, user_id=user, infer=False)
    m._test_state = str(tmp_path / "state")  # the journal folder of a server vector store
    return m


def source(memory):
    return Mem0Source(memory, state_dir=memory._test_state)


def run(snap):
    return run_pass(
        snap.records,
        cfg=PassConfig(force=True, threshold=0.9),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=float(snap.records.meta["last_used"].max()) + 1,
    )


def test_merges_through_mem0_as_a_mem0_user_sees_them(memory, tmp_path):
    src = source(memory)
    snap = src.read()
    assert len(snap.records) == 10 and snap.records.dim == 384
    assert sorted(set(snap.records.meta["namespace"])) == ["alice", "bob"]
    res = run(snap)
    plan = src.plan(snap, res.records)
    # the embedded store over the same records gives the same merges
    s = LanceStore(tmp_path / "s")
    s.create(snap.records)
    es = s.load()
    eres = run(es)
    want = sorted(
        tuple(sorted(e["members"])) for e in eres.events if e["op"] in ("merge", "exact_merge")
    )
    assert sorted(tuple(u["ids"]) for u in plan.units) == want and len(want) >= 2
    # a dry run changes nothing
    before = {
        r["id"]: r["memory"]
        for u in NOTES
        for r in memory.get_all(filters={"user_id": u}, top_k=100)["results"]
    }
    rep = src.apply(plan)
    assert rep.dry_run and rep.applied == {"merge": len(want)}
    after = {
        r["id"]: r["memory"]
        for u in NOTES
        for r in memory.get_all(filters={"user_id": u}, top_k=100)["results"]
    }
    assert after == before
    rep = src.apply(plan, dry_run=False)
    assert rep.applied == {"merge": len(want)} and not rep.skipped
    after = {
        r["id"]: r["memory"]
        for u in NOTES
        for r in memory.get_all(filters={"user_id": u}, top_k=100)["results"]
    }
    assert len(after) == 10 - sum(len(u["delete"]) for u in plan.units)
    for u in plan.units:
        assert after[u["keep"]] == u["text"] and not set(u["delete"]) & set(after)
        hist = memory.history(u["keep"])
        assert [h["event"] for h in hist][-1] == "UPDATE" and hist[-1]["new_memory"] == u["text"]
        for i in u["delete"]:
            assert memory.history(i)[-1]["event"] == "DELETE"
    # search finds the merged note
    hit = memory.search("Where did Alice move?", filters={"user_id": "alice"}, top_k=1)
    assert "Berlin" in hit["results"][0]["memory"]
    # undo puts every member back, text and vector, except one an agent changed since
    edited = plan.units[-1]["keep"]
    memory.update(edited, text="Bob plays the viola now.")
    got = src.undo(plan.plan_id[:10])
    assert len(got.restored) == sum(len(u["ids"]) for u in plan.units) - 1
    assert sorted(got.undone) == sorted(u["key"] for u in plan.units)
    assert got.skipped == [
        {
            "key": plan.units[-1]["key"],
            "id": edited,
            "why": "changed or deleted since the apply: the agent's version kept",
        }
    ]
    assert memory.get(edited)["memory"] == "Bob plays the viola now."
    again = src.undo(plan.plan_id[:10])  # run twice: nothing twice
    assert again.restored == [] and sorted(again.already) == sorted(got.undone)
    assert memory.get(edited)["memory"] == "Bob plays the viola now."
    memory.update(edited, text=snap.payloads[edited]["data"])  # the agent puts it back
    back = src.read()
    assert sorted(back.records.meta["text"]) == sorted(snap.records.meta["text"])
    i = plan.units[0]["keep"]
    k0, k1 = (list(r.meta["id"]).index(i) for r in (snap.records, back.records))
    np.testing.assert_allclose(back.records.vectors[k1], snap.records.vectors[k0], atol=1e-6)


def test_an_edited_member_keeps_its_cluster_unmerged(memory, tmp_path):
    src = source(memory)
    snap = src.read()
    plan = src.plan(snap, run(snap).records)
    victim = plan.units[0]["ids"][-1]
    memory.update(victim, text="Alice moved to Munich in 2023.")  # an agent's edit
    rep = src.apply(plan, dry_run=False)
    assert [s["unit"] for s in rep.skipped] == [0] and victim in rep.skipped[0]["why"]
    got = memory.get(victim)
    assert got["memory"] == "Alice moved to Munich in 2023."
    assert all(memory.get(i) is not None for i in plan.units[0]["ids"])
    assert os.path.exists(src.journal.dir / "applied.jsonl")  # the other units were applied


def test_the_consolidate_job_on_a_mem0_store(tmp_path, monkeypatch, compose_cfg):
    """`consolidate source=mem0 source.mem0...=...`: a dry run, then source.apply=true
    (the merged texts visible through Mem0's get_all, the undo journal written beside the
    Qdrant folder)."""
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    from mem0 import Memory

    from consolidate.embed import packaged_model_path
    from consolidate.jobs.consolidate import format_summary, run_consolidate

    over = [
        f"source.mem0.vector_store.config.path={tmp_path / 'qdrant'}",
        f"source.mem0.embedder.config.model={packaged_model_path()}",
        f"source.mem0.history_db_path={tmp_path / 'history.db'}",
    ]
    base = compose_cfg("consolidate", overrides=["source=mem0", *over])
    m = Memory.from_config(dict(as_dict(base.source.mem0)))
    for user, notes in NOTES.items():
        for text in notes:
            m.add(text, user_id=user, infer=False)
    del m  # Qdrant's local mode allows one client per folder

    def job(*more):
        cfg = compose_cfg(
            "consolidate",
            overrides=[
                "source=mem0",
                *over,
                "similarity.device=cpu",
                "sleep.force=true",
                *more,
            ],
        )
        return run_consolidate(cfg, out_dir=str(tmp_path / f"run{len(more)}"))

    s = job()
    assert s["dry_run"] and s["records_read"] == 10 and s["external"]["units"]["merge"] == 3
    assert "store            mem0 store" in format_summary(s)
    s2 = job("source.apply=true")
    assert s2["external"]["applied"] == {"merge": 3}
    journal = (tmp_path / "qdrant.consolidate" / "applied.jsonl").read_text()
    assert journal.count("\n") == 3 and journal.count('"members"') == 3
    m = Memory.from_config(dict(as_dict(base.source.mem0)))
    alice = m.get_all(filters={"user_id": "alice"}, top_k=100)["results"]
    assert len(alice) == 4


def as_dict(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    """The Mem0 command of docs/source-settings.md, in a folder where an agent's Mem0 store lives in mem0/."""
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    from mem0 import Memory

    from consolidate.embed import packaged_model_path
    from tests.helpers import run_readme_example

    def open_mem0():
        return Memory.from_config(
            {
                "vector_store": {
                    "provider": "qdrant",
                    "config": {
                        "path": str(tmp_path / "mem0" / "qdrant"),
                        "collection_name": "mem0",
                        "embedding_model_dims": 384,
                        "on_disk": True,
                    },
                },
                "embedder": {
                    "provider": "huggingface",
                    "config": {"model": str(packaged_model_path())},
                },
                "history_db_path": str(tmp_path / "mem0" / "history.db"),
            }
        )

    m = open_mem0()
    for user, notes in NOTES.items():
        for text in notes:
            m.add(text, user_id=user, infer=False)
    del m  # Qdrant's local mode allows one client per folder
    import gc

    gc.collect()
    p = run_readme_example(
        "mem0",
        tmp_path,
        {"MODEL": str(packaged_model_path()), "MEM0_TELEMETRY": "False"},
        doc="docs/source-settings.md",
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "applied          3 merge" in p.stdout
    m = open_mem0()
    assert len(m.get_all(filters={"user_id": "alice"}, top_k=100)["results"]) == 4


def test_importance_and_pinned_from_mem0_metadata(memory):
    """Importance and pin kept in Mem0 metadata are read (configurable keys); a value of
    the wrong type is refused naming the memory and the key."""
    memory.add(
        "Bob is allergic to penicillin.",
        user_id="bob",
        infer=False,
        metadata={"importance": 0.95, "pinned": True},
    )
    memory.add("Bob likes jazz.", user_id="bob", infer=False, metadata={"prio": "0.2"})
    m = Mem0Source(memory).read().records.meta.set_index("text")
    assert m.at["Bob is allergic to penicillin.", "importance"] == 0.95
    assert bool(m.at["Bob is allergic to penicillin.", "pinned"])
    assert m.at["Bob likes jazz.", "importance"] == 0.5 and not m.at["Bob likes jazz.", "pinned"]
    m2 = Mem0Source(memory, importance_key="prio", pinned_key=None).read().records.meta
    m2 = m2.set_index("text")
    assert m2.at["Bob likes jazz.", "importance"] == 0.2
    assert not m2.at["Bob is allergic to penicillin.", "pinned"]
    memory.add("Bob owns a boat.", user_id="bob", infer=False, metadata={"importance": "high"})
    with pytest.raises(
        ValueError, match=r"Mem0 memory .+: metadata 'importance' is 'high', not a number"
    ):
        Mem0Source(memory).read()


def test_undo_by_merge_and_plan_prefix_twice_and_no_merge_again(memory):
    """The promise every source keeps (tests/sources/test_undo_sources.py::check_undo): one merge
    undone by a prefix of its merged id, the rest of the plan by a prefix of the plan id,
    a second undo restores nothing, and the next pass keeps the members apart."""
    from tests.sources.test_undo_sources import check_undo, live, one_pass

    src = Mem0Source(memory, state_dir=memory._test_state, drops=True)
    before = live(src)
    _, _, plan, rep = one_pass(src)
    assert rep.applied == {"merge": 3} and (src.journal.dir / "applied.jsonl").exists()
    assert len(live(src)) == len(before) - sum(len(u["ids"]) - 1 for u in plan.units)
    check_undo(src, before, plan, drops=False)
    # Mem0's history tells the restore: a deleted member's last event is an ADD again
    for u in plan.units:
        for i in u["ids"]:
            if i != u["keep"]:
                hist = memory.history(i)
                assert [h["event"] for h in hist[-2:]] == ["DELETE", "ADD"]
                assert hist[-1]["new_memory"] == before[i]
