"""How much of the whole pass is left without its per-text work (an experiment, not a test).

Runs :func:`consolidate.pipeline.run_pass` on the pass benchmark's synthetic store
(:func:`consolidate.bench.pass_bench.make_pass_store`, namespaces of ``--ns-size`` rows)
``--repeats`` times each way, alternating, in one process:

- ``full``: the pass as it is (extractive merger, conflict guard, fidelity check);
- ``no text work``: the same pass with its per-text Python replaced by constant-time
  stand-ins: the conflict guard answers "no conflict" for every candidate pair (each item a
  class of its own), the extractive merger answers each cluster with its first member's
  text, and the fidelity check finds nothing lost.

Everything else (purge, exact groups, the similarity join, clustering, the requests, the
merged rows, scoring, the output) runs unchanged. On a store whose guard finds no conflict
(the synthetic one) both ways form the same clusters and merges; the script checks the
counts agree and stops otherwise. The difference between the two is what the text rules
cost; the second is the floor of the pass's array and row-table work, which no change to the
text rules can remove. Stage times are ``stats.time_s``; ``non-sim`` is the pass's wall time
less its similarity stage.

Usage: ``python -m consolidate.bench.pass_floor --n 1000000 --out eval/pass_floor_<date>``
(52 s with two repeats, 73 s with three, at 10^6 on the 2-core machine; about 8 GB of
memory). Writes ``report.md`` and ``results.json``. The store is built in the measuring
process, so its passes run slower than the pass benchmark's on a loaded store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

import numpy as np

from consolidate.bench.pass_bench import make_pass_store
from consolidate.config import PassConfig, SimilarityConfig
from consolidate.environment import git_commit, machine
from consolidate.ops.merge import ExtractiveMerger, MergeRequest, MergeResponse
from consolidate.pipeline import merging, near, run_pass
from consolidate.store.schema import Records

COUNTS = ("clusters", "merges", "exact_merges", "review_pairs", "merged_members")


def _no_guard(
    texts: list[str],
    ci: np.ndarray,
    cj: np.ndarray,
    parts: list[tuple[int, int]],
    workers: int,
    not_shared: Sequence[np.ndarray] = (),
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stand-in for :func:`consolidate.pipeline.near.guard_pairs` (same arguments and
    returns): every item a class of its own, every pair's reason ``None``."""
    m = len(texts)
    keys = np.sort(np.minimum(ci, cj) * m + np.maximum(ci, cj))
    return np.arange(m, dtype=np.int64), keys, np.full(len(keys), None, dtype=object)


def _first_text(self: ExtractiveMerger, requests: Sequence[MergeRequest]) -> list[MergeResponse]:
    """Stand-in for ``ExtractiveMerger.merge_batch``: each cluster's first member's text."""
    return [MergeResponse(r.members[0].text) for r in requests]


@contextlib.contextmanager
def _without_text_work() -> Iterator[None]:
    """The stand-ins in place (forked text workers inherit them), removed on exit."""
    with (
        mock.patch.object(near, "guard_pairs", _no_guard),
        mock.patch.object(ExtractiveMerger, "merge_batch", _first_text),
        mock.patch.object(merging, "checked_merge", lambda req, resp, threshold: {}),
    ):
        yield


def _once(recs: Records, cfg: PassConfig, sim: SimilarityConfig, floor: bool) -> dict:
    """One timed :func:`run_pass` on ``recs``, with the stand-ins when ``floor``: its way,
    wall time and similarity stage (s), stage times, rows out and :data:`COUNTS`."""
    ctx = _without_text_work() if floor else contextlib.nullcontext()
    with ctx:
        t = time.perf_counter()
        res = run_pass(recs, cfg=cfg, sim_cfg=sim, version=2, wall_h=500000.0)
        wall = time.perf_counter() - t
    stages = dict(res.stats.time_s)
    return {
        "way": "no text work" if floor else "full",
        "pass_s": round(wall, 3),
        "similarity_s": stages.get("similarity", 0.0),
        "non_sim_s": round(wall - stages.get("similarity", 0.0), 3),
        "stages": stages,
        "out": len(res.records.meta),
        **{k: getattr(res.stats, k) for k in COUNTS},
    }


def floor_runs(n: int, ns_size: int, repeats: int) -> tuple[list[dict], dict]:
    """``repeats`` passes each way (full, no text work), alternating, on the store of
    ``make_pass_store(n, ns_size, seed=0)`` after an untimed warm-up pass on its first 2,000
    rows. Returns ``(runs, info)``: per run its way, wall time (s), ``stats.time_s``,
    ``non_sim_s``, rows out (tombstones included) and the counts of :data:`COUNTS`; and what
    the store planted (:func:`~consolidate.bench.pass_bench.make_pass_store`).

    Raises:
        SystemExit: the stand-ins changed a count (the store has conflicting pairs, or the
            pass changed what the stand-ins replace)."""
    recs, info = make_pass_store(n, ns_size, seed=0, now_h=500000.0)
    cfg = PassConfig(
        threshold=0.9, cap=None, max_drop_fraction=1.0, max_namespace_drop_fraction=1.0
    )
    sim = SimilarityConfig(device="cpu", dtype="fp32")
    run_pass(recs.take(np.arange(min(n, 2000))), cfg=cfg, sim_cfg=sim, version=2, wall_h=500000.0)
    runs = [_once(recs, cfg, sim, floor) for _ in range(repeats) for floor in (False, True)]
    for r in runs:
        if any(r[k] != runs[0][k] for k in (*COUNTS, "out")):
            raise SystemExit(f"the stand-ins changed the pass's counts: {r} against {runs[0]}")
    return runs, info


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--ns-size", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.n < 2 or args.ns_size < 2 or args.n % args.ns_size:
        ap.error("--repeats must be >= 1, and --n a multiple of --ns-size (both >= 2)")
    t0 = time.perf_counter()
    runs, _ = floor_runs(args.n, args.ns_size, args.repeats)
    best = {
        w: min((r for r in runs if r["way"] == w), key=lambda r: r["pass_s"])
        for w in ("full", "no text work")
    }
    mach = machine()
    lines = [
        "# The pass without its per-text work",
        "",
        f"`python -m consolidate.bench.pass_floor --n {args.n} --ns-size {args.ns_size} --repeats "
        f"{args.repeats} --out {args.out}` on {mach['cpu']} ({mach['cpus']} cpus), "
        f"git {git_commit(short=True, dirty=True)}, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}; {time.perf_counter() - t0:.0f} s in all; "
        f"load average at end {[round(x, 2) for x in os.getloadavg()]}.",
        "",
        f"n = {args.n}, namespaces of {args.ns_size}; both ways: {runs[0]['clusters']} clusters, "
        f"{runs[0]['merges']} merges, {runs[0]['exact_merges']} exact merges, "
        f"{runs[0]['review_pairs']} reviewed pairs, {runs[0]['out']} rows out.",
        "",
        "| way | pass s | similarity s | non-sim s | non-sim / sim | stages (s) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        st = ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items() if v)
        lines.append(
            f"| {r['way']} | {r['pass_s']:.2f} | {r['similarity_s']:.2f} | {r['non_sim_s']:.2f} "
            f"| {r['non_sim_s'] / r['similarity_s']:.2f}x | {st} |"
        )
        print(lines[-1], flush=True)
    f, b = best["full"], best["no text work"]
    lines += [
        "",
        f"Fastest of each way: full {f['pass_s']:.2f} s (non-sim {f['non_sim_s']:.2f} s = "
        f"{f['non_sim_s'] / f['similarity_s']:.2f}x the similarity stage); without text work "
        f"{b['pass_s']:.2f} s (non-sim {b['non_sim_s']:.2f} s = "
        f"{b['non_sim_s'] / b['similarity_s']:.2f}x). The text rules cost "
        f"{f['pass_s'] - b['pass_s']:.2f} s of the pass's wall time.",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(runs, indent=1) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
