"""Store benchmark: the Lance store against the Parquet store, measured in the same run.

Usage::

    python -m consolidate.bench.store_bench [--n 1000000] [--ns-size 100] [--out eval/store_bench]

For each format it builds a synthetic store (``consolidate.bench.pass_bench``'s generator: d=384,
``n / ns_size`` namespaces), then times each operation in a fresh process (so each peak
RSS is that operation's own): ``load`` (into the pass's columns), ``append`` of 10
records, ``mark_used`` of 10 ids, and a commit that changes 1% of the rows against one that
changes all of them (a full rewrite), a 1% commit as a pass hands it over (0.25% of the
rows purged, 0.5% changed, 0.25% new, the vectors a fresh copy), and a nightly run after
1% of the namespaces got a new memory (trigger plus load of what it reads). It writes
``results.json`` and ``report.md`` with the ratios the store issue sets as targets (append
and mark_used <= 0.5 s, load <= 10 s, peak RSS of load <= 2x vectors + texts, 1% commit
<= 5% of a full rewrite, an incremental run reads <= 3% of the rows).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from consolidate.environment import git_commit, machine

REPO = Path(__file__).resolve().parents[2]


def _hwm() -> int:
    """Peak RSS of this process in bytes (``VmHWM``)."""
    from consolidate.bench import pass_bench

    return pass_bench._proc_status("VmHWM")


def _rss() -> int:
    """RSS of this process in bytes (``VmRSS``)."""
    from consolidate.bench import pass_bench

    return pass_bench._proc_status("VmRSS")


def _open(fmt: str, root: str):
    from consolidate.store import Store
    from consolidate.store.lance import LanceStore

    return LanceStore(root) if fmt == "lance" else Store(root)


def step(name: str, fmt: str, root: str, n: int, ns_size: int) -> dict:
    """One timed operation (:data:`STEPS`) in this process; returns seconds and memory in
    bytes.

    Raises:
        ValueError: an unknown step name.
    """
    if name not in STEPS:
        raise ValueError(name)
    out: dict = {"step": name, "format": fmt}
    STEPS[name](name, fmt, root, n, ns_size, out)
    return out


def _create(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """A new store of ``n`` benchmark rows (:func:`~consolidate.bench.pass_bench.make_pass_store`)."""
    from consolidate.bench import pass_bench

    recs, info = pass_bench.make_pass_store(n, ns_size, seed=0)
    out.update(vector_bytes=info["vector_bytes"], text_bytes=info["text_bytes"])
    base = _rss()
    t = time.perf_counter()
    _open(fmt, root).create(recs, source="store-bench")
    out["s"] = time.perf_counter() - t
    out["rss_before"] = base
    out["disk_bytes"] = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def _load(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """A whole load, with the peak memory."""
    s = _open(fmt, root)
    base = _rss()
    t = time.perf_counter()
    snap = s.load()
    out["s"] = time.perf_counter() - t
    out["rows"] = len(snap.records)
    out["rss_before"], out["peak"] = base, _hwm()


def _write(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """``append``: 10 new memories; ``mark_used``: 10 recalls."""
    import numpy as np

    s = _open(fmt, root)
    rng = np.random.default_rng(1)
    if name == "append":
        v = rng.normal(size=(10, 384)).astype(np.float32)
        rows = [
            {
                "id": f"bench-new-{time.time_ns()}-{k}",
                "namespace": "ns000000",
                "text": f"a new fact number {k}",
                "vector": v[k].tolist(),
                "importance": 0.5,
            }
            for k in range(10)
        ]
        t = time.perf_counter()
        s.append(rows)
    else:
        ids = [f"mem-{x:08x}" for x in rng.choice(n, 10, replace=False)]
        t = time.perf_counter()
        s.mark_used(ids)
    out["s"] = time.perf_counter() - t


def _commit(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """A commit with the strength of 1% (``commit_1pct``) or all (``commit_all``) rows
    changed."""
    import numpy as np

    from consolidate.store import Records

    s = _open(fmt, root)
    with s.lock():
        snap = s.load()
        meta = snap.records.meta.copy()
        rng = np.random.default_rng(2)
        k = len(meta) // 100 if name == "commit_1pct" else len(meta)
        rows = rng.choice(len(meta), k, replace=False)
        st = meta["strength"].to_numpy(np.float64).copy()
        st[rows] += 1.0
        meta["strength"] = st
        recs = Records(meta, snap.records.vectors)
        t = time.perf_counter()
        info = s.commit(recs, [{"op": "bench", "changed": int(k)}], base=snap)
        out["s"] = time.perf_counter() - t
        out["changed"] = int(k)
        out["rows_written"] = info.get("rows_written", len(meta))


def _commit_mixed(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """What a pass hands over: 0.25% of the rows purged, 0.5% changed, 0.25% new (merged)
    rows, the vectors a fresh copy (the pass gathers the survivors)."""
    import numpy as np

    from consolidate.store import Records
    from consolidate.store.schema import records_from_rows

    s = _open(fmt, root)
    with s.lock():
        snap = s.load()
        rng = np.random.default_rng(4)
        n_all = len(snap.records)
        k = n_all // 400
        keep = np.sort(rng.choice(n_all, n_all - k, replace=False))
        kept = snap.records.take(keep)
        meta = kept.meta.copy()
        rows = rng.choice(len(meta), 2 * k, replace=False)
        st = meta["strength"].to_numpy(np.float64).copy()
        st[rows] += 1.0
        meta["strength"] = st
        v = rng.normal(size=(k, snap.dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        new = records_from_rows(
            [
                {
                    "id": f"bench-merged-{j}",
                    "namespace": "ns000000",
                    "text": f"merged fact {j}",
                    "vector": v[j],
                    "importance": 0.5,
                }
                for j in range(k)
            ],
            dim=snap.dim,
        )
        recs = Records.concat([Records(meta, kept.vectors, origin=kept.origin), new], snap.dim)
        t = time.perf_counter()
        info = s.commit(recs, [{"op": "bench", "changed": int(4 * k)}], base=snap)
        out["s"] = time.perf_counter() - t
        out["changed"] = int(4 * k)
        out["rows_written"] = info.get("rows_written", len(recs))
        out["rows_deleted"] = info.get("rows_deleted", k)


def _incremental(name: str, fmt: str, root: str, n: int, ns_size: int, out: dict) -> None:
    """A nightly run after 1% of the namespaces got one new memory each: every stored row
    seen by a pass (``last_pass`` set), then 100 appends; times the per-namespace trigger
    plus the load of what fired."""
    import numpy as np

    from consolidate.store import Records

    s = _open(fmt, root)
    with s.lock():
        snap = s.load()
        meta = snap.records.meta.copy()
        meta["last_pass"] = 1.0
        s.commit(Records(meta, snap.records.vectors), [{"op": "bench"}], base=snap)
    del snap, meta
    n_ns = n // ns_size
    fired_ns = [f"ns{k:06d}" for k in range(0, n_ns, 100)]
    rng = np.random.default_rng(3)
    v = rng.normal(size=(len(fired_ns), 384)).astype(np.float32)
    s.append(
        [
            {
                "id": f"bench-inc-{k}",
                "namespace": ns,
                "text": f"new fact for {ns}",
                "vector": v[k].tolist(),
                "importance": 1.0,
            }
            for k, ns in enumerate(fired_ns)
        ]
    )
    t = time.perf_counter()
    if fmt == "lance":
        fired, _ = s.trigger(0.5)
        snap = s.load(namespaces=fired)
    else:
        from consolidate.pipeline import trigger

        snap = s.load()
        trigger(snap.records, 0.5)
        fired = sorted(set(snap.records.meta["namespace"][snap.records.meta["last_pass"].isna()]))
    out["s"] = time.perf_counter() - t
    out["namespaces_fired"] = len(fired)
    out["rows_read"] = len(snap.records)
    out["rows_total"] = s._open().count_rows() if fmt == "lance" else len(snap.records)


#: the store benchmark's steps, each run in a process of its own (:func:`run_step`)
STEPS = {
    "create": _create,
    "load": _load,
    "append": _write,
    "mark_used": _write,
    "commit_1pct": _commit,
    "commit_all": _commit,
    "commit_1pct_mixed": _commit_mixed,
    "incremental": _incremental,
}


def run_step(name: str, fmt: str, root: str, n: int, ns_size: int) -> dict:
    """Run one measured step (``--step name``) of the store benchmark in a fresh process on
    the store at ``root`` and return its JSON result."""
    p = subprocess.run(
        [
            sys.executable,
            __file__,
            "--step",
            name,
            "--format",
            fmt,
            "--root",
            root,
            "--n",
            str(n),
            "--ns-size",
            str(ns_size),
        ],
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise RuntimeError(f"step {name} ({fmt}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    """Command line (``python -m consolidate.bench.store_bench``): build a Lance and a
    Parquet store of ``--n`` memories and time each step of :data:`STEPS` on both, one
    process per step; or, with ``--step``, run that one step. Returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--ns-size", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default=None, help="where the stores are built (deleted after)")
    ap.add_argument("--step", default=None)
    ap.add_argument("--format", default=None)
    ap.add_argument("--root", default=None)
    a = ap.parse_args(argv)
    if a.step:
        print(json.dumps(step(a.step, a.format, a.root, a.n, a.ns_size)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="store-bench-", dir=a.tmp))
    results: dict = {
        "n": a.n,
        "ns_size": a.ns_size,
        "d": 384,
        "git": git_commit(short=True, dirty=True),
        **machine(),
        "formats": {},
    }
    try:
        for fmt in ("parquet", "lance"):
            root = str(tmp / fmt)
            r: dict = {}
            for name in (
                "create",
                "load",
                "append",
                "mark_used",
                "commit_1pct",
                "commit_1pct_mixed",
                "commit_all",
                "incremental",
            ):
                r[name] = run_step(name, fmt, root, a.n, a.ns_size)
                print(f"{fmt:8s} {name:12s} {r[name]['s']:8.3f} s", flush=True)
            results["formats"][fmt] = r
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = _report(results, a.n, a.ns_size)
    print(report)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "report.md").write_text(report)
    return 0


def _report(results: dict, n: int, ns_size: int) -> str:
    """``report.md`` of a run's ``results`` (adds the ratios it states to them)."""
    data = (
        results["formats"]["lance"]["create"]["vector_bytes"]
        + results["formats"]["lance"]["create"]["text_bytes"]
    )
    results["data_bytes"] = data
    lines = [
        f"# Store benchmark: n = {n:,}, d = 384, {n // ns_size:,} namespaces, "
        f"{results['cpus']} CPUs ({results['cpu']}), commit {results['git']}",
        "",
        "| operation | parquet | lance | target (lance) |",
        "| --- | ---: | ---: | --- |",
    ]
    f = results["formats"]
    for name, target in (
        ("create", ""),
        ("load", "<= 10 s"),
        ("append", "<= 0.5 s (10 rows)"),
        ("mark_used", "<= 0.5 s (10 ids)"),
        ("commit_1pct", "<= 5% of commit_all"),
        ("commit_1pct_mixed", "as a pass hands it over"),
        ("commit_all", ""),
        ("incremental", "trigger + load of 1% fired"),
    ):
        lines.append(
            f"| {name} | {f['parquet'][name]['s']:.3f} s | "
            f"{f['lance'][name]['s']:.3f} s | {target} |"
        )
    for fmt in ("parquet", "lance"):
        ld = f[fmt]["load"]
        f[fmt]["load_peak_over_data"] = (ld["peak"] - ld["rss_before"]) / data
        f[fmt]["commit_ratio"] = f[fmt]["commit_1pct"]["s"] / f[fmt]["commit_all"]["s"]
        f[fmt]["commit_mixed_ratio"] = f[fmt]["commit_1pct_mixed"]["s"] / f[fmt]["commit_all"]["s"]
    lines += [
        "",
        f"- data (vectors fp32 + texts): {data / 1e9:.2f} GB",
        *[
            f"- {fmt}: load peak RSS over the process before it = "
            f"{f[fmt]['load_peak_over_data']:.2f}x data (target <= 2x); 1% commit / full "
            f"rewrite = {f[fmt]['commit_ratio']:.3f} (target <= 0.05), as a pass hands "
            f"it over (purges, new rows, copied vectors) "
            f"{f[fmt]['commit_mixed_ratio']:.3f}; on disk "
            f"{f[fmt]['create']['disk_bytes'] / 1e9:.2f} GB"
            for fmt in ("parquet", "lance")
        ],
        *[
            f"- {fmt}: a nightly run after 1% of the namespaces got a new memory read "
            f"{f[fmt]['incremental']['rows_read']:,} of "
            f"{f[fmt]['incremental']['rows_total']:,} rows "
            f"({f[fmt]['incremental']['rows_read'] / f[fmt]['incremental']['rows_total']:.2%}"
            f"; target <= 3%)"
            for fmt in ("parquet", "lance")
        ],
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
