"""Fleet benchmark: the pass on Ray Data against the single-process pass, in the same run.

Usage::

    python -m consolidate.bench.fleet_bench [--n 200000] [--ns-size 100] [--actors 2] [--cpus 2]
                                  [--out eval/fleet_bench]

Builds one synthetic Lance store (``consolidate.bench.pass_bench``'s generator: d=384,
``n / ns_size`` namespaces, planted exact and near duplicates) and copies it. Then, on the
two copies:

1. **full pass** (the first pass over the store): load + pass + commit in this process,
   against plan + Ray Data shards + commit on a local Ray cluster of ``--cpus`` CPUs with
   ``--actors`` actors. The committed stores are compared row by row (every column and
   vector component).
2. **nightly run**: 1% of the namespaces get a new memory each; an incremental run over the
   namespaces that fired, both ways (counts compared).

The cluster's start-up is timed apart (a nightly job on a running cluster does not pay it).
It writes ``results.json`` and ``report.md`` with the overhead ratio fleet / single.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from consolidate.environment import git_commit, machine

REPO = Path(__file__).resolve().parents[2]


def _single(store, pc, sc, wall, namespaces=None):
    from consolidate.pipeline import run_pass

    t = time.perf_counter()
    with store.lock():
        snap = store.load(namespaces=namespaces)
        t_load = time.perf_counter() - t
        res = run_pass(snap.records, cfg=pc, sim_cfg=sc, version=snap.version + 1, wall_h=wall)
        t_pass = time.perf_counter() - t - t_load
        info = store.commit(res.records, res.events, base=snap, pass_time_h=wall)
    return {
        "wall_s": time.perf_counter() - t,
        "load_s": t_load,
        "pass_s": t_pass,
        "stats": res.stats.as_dict(),
        "rows_written": info["rows_written"],
    }


def _fleet(store, pc, sc, rc, wall, namespaces=None):
    from consolidate.fleet import run_fleet_pass

    t = time.perf_counter()
    with store.lock():
        out = run_fleet_pass(
            store, namespaces=namespaces, pass_cfg=pc, sim_cfg=sc, runner=rc, wall_h=wall
        )
    return {
        "wall_s": time.perf_counter() - t,
        "fleet": out["fleet"],
        "stats": out["stats"].as_dict(),
        "rows_written": out["commit"]["rows_written"],
    }


def _same(a, b) -> bool:
    import numpy as np

    ra, rb = a.load().records, b.load().records
    ia = np.argsort(ra.meta["id"].to_numpy(str))
    ib = np.argsort(rb.meta["id"].to_numpy(str))
    return ra.meta.iloc[ia].reset_index(drop=True).equals(
        rb.meta.iloc[ib].reset_index(drop=True)
    ) and np.array_equal(ra.vectors[ia], rb.vectors[ib])


def main(argv: list[str]) -> int:
    """Command line (``python -m consolidate.bench.fleet_bench``): the same store passed by
    one process and by the Ray fleet, full and nightly; writes the report to ``--out``.
    Returns 0 when both give the same records."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--ns-size", type=int, default=100)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--max-rows-per-shard", type=int, default=100_000)
    ap.add_argument("--out", default="eval/fleet_bench")
    args = ap.parse_args(argv)

    import ray
    import torch

    import consolidate.store.lance.writing as ls
    from consolidate.bench import pass_bench
    from consolidate.config import PassConfig, RunnerConfig, SimilarityConfig
    from consolidate.store.lance import LanceStore
    from consolidate.store.schema import hours_now

    # both commits upsert (a fleet commit never rewrites): the stores then number their
    # versions alike, and merged ids (which mix in the version) can be compared
    ls.REWRITE_FRACTION = 1.01
    work = Path(tempfile.mkdtemp(prefix="fleet_bench_"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "n": args.n,
        "ns_size": args.ns_size,
        "actors": args.actors,
        "cpus": args.cpus,
        "torch_threads_single": torch.get_num_threads(),
        "max_rows_per_shard": args.max_rows_per_shard,
        "commit": git_commit(short=True, dirty=True),
        "machine": machine(),
    }
    try:
        wall = hours_now() - 1.0
        recs, info = pass_bench.make_pass_store(args.n, args.ns_size, now_h=wall - 1.0)
        res["generated"] = {
            k: info[k] for k in ("namespaces", "planted_clusters", "duplicate_rows")
        }
        a = LanceStore(work / "single")
        a.create(recs)
        del recs
        shutil.copytree(a.root, work / "fleet")
        b = LanceStore(work / "fleet")
        pc, sc = PassConfig(force=True), SimilarityConfig(device="cpu")
        rc = RunnerConfig(
            kind="ray",
            actors=args.actors,
            cpus_per_actor=1.0,
            max_rows_per_shard=args.max_rows_per_shard,
        )
        t = time.perf_counter()
        ray.init(
            num_cpus=args.cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        res["ray_start_s"] = round(time.perf_counter() - t, 3)
        res["full_single"] = _single(a, pc, sc, wall)
        res["full_fleet"] = _fleet(b, pc, sc, rc, wall)
        res["full_same_records"] = _same(a, b)
        res.update(_nightly(a, b, sc, rc, wall))
        ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k in ("full", "nightly"):
        res[f"{k}_ratio"] = round(res[f"{k}_fleet"]["wall_s"] / res[f"{k}_single"]["wall_s"], 3)
    (out_dir / "results.json").write_text(json.dumps(res, indent=2, default=float))
    lines = _report_lines(res)
    (out_dir / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if res["full_same_records"] and res["nightly_same_records"] else 1


def _nightly(a: Any, b: Any, sc: Any, rc: Any, wall: float) -> dict[str, Any]:
    """The nightly case on both stores (``a`` single process, ``b`` fleet): one new memory
    in 1% of the namespaces, the trigger, the pass over what fired, the records compared."""
    import numpy as np

    from consolidate.bench import pass_bench
    from consolidate.config import PassConfig

    ns = sorted(set(a.load(validate_records=False).records.meta["namespace"]))
    rng = np.random.default_rng(1)
    fired = sorted(rng.choice(ns, max(1, len(ns) // 100), replace=False).tolist())
    new, _ = pass_bench.make_pass_store(len(fired) * 10, 10, now_h=wall)
    new = new.take(np.arange(0, len(new), 10))
    new.meta["namespace"] = fired
    new.meta["id"] = [f"new-{k}" for k in range(len(fired))]
    new.meta["importance"] = 1.0
    for s in (a, b):
        s.append(new)
    pc2 = PassConfig(trigger_importance=1.0)
    fa, _ = a.trigger(pc2.trigger_importance)
    fb, _ = b.trigger(pc2.trigger_importance)
    return {
        "nightly_fired": [len(fa), len(fb), len(ns)],
        "nightly_single": _single(a, pc2, sc, wall + 24, namespaces=fa),
        "nightly_fleet": _fleet(b, pc2, sc, rc, wall + 24, namespaces=fb),
        "nightly_same_records": _same(a, b),
    }


def _report_lines(res: dict[str, Any]) -> list[str]:
    """``report.md`` of a run's results."""
    n, ns_size = res["n"], res["ns_size"]
    actors, cpus, max_rows = res["actors"], res["cpus"], res["max_rows_per_shard"]
    fs, ff = res["full_single"], res["full_fleet"]
    ns_, nf = res["nightly_single"], res["nightly_fleet"]
    lines = [
        f"# Fleet benchmark (n = {n}, {n // ns_size} namespaces, d = 384; commit {res['commit']})",
        "",
        f"Local Ray cluster: {cpus} CPUs, {actors} actors of 1 CPU, shards of at "
        f"most {max_rows} rows; single process: {res['torch_threads_single']} "
        f"torch threads. Ray start-up {res['ray_start_s']} s (not counted below).",
        "",
        "| run | single process (s) | fleet on Ray (s) | fleet / single | shards | same records |",
        "|---|---|---|---|---|---|",
        f"| full pass (first pass over the store) | {fs['wall_s']:.2f} | {ff['wall_s']:.2f} | "
        f"{res['full_ratio']} | {ff['fleet']['shards']} | {res['full_same_records']} |",
        f"| nightly, {res['nightly_fired'][0]} of {res['nightly_fired'][2]} namespaces fired "
        f"| {ns_['wall_s']:.2f} | {nf['wall_s']:.2f} | {res['nightly_ratio']} | "
        f"{nf['fleet']['shards']} | {res['nightly_same_records']} |",
        "",
        f"Full pass, single process: load {fs['load_s']:.2f} s, pass {fs['pass_s']:.2f} s, "
        f"{fs['rows_written']} rows written; fleet: plan {ff['fleet']['plan_s']} s, Ray "
        f"{ff['fleet']['ray_s']} s, {ff['rows_written']} rows written, "
        f"{ff['fleet']['workers']} worker processes.",
        "",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
