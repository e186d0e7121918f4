#!/usr/bin/env python3
"""Side-by-side benchmark: ``consolidate.ops.minhash`` against ``datasketch`` (MinHash +
MinHashLSH) on synthetic long texts with planted near-duplicates.

Both methods see the same texts, the same segments (namespaces), ``num_perm`` and threshold,
and the same shingles: word 3-grams of ``consolidate.text.normalise(text).split()``.

* ours: :func:`~consolidate.ops.minhash.minhash_signatures` (signature time), then
  :func:`~consolidate.ops.minhash.signature_pairs` (LSH/pair time: banding, candidate pairs,
  estimate >= threshold). Run with the default band choice (``fn_weight=0.5``, the
  unweighted S-curve error, like datasketch's default) and with ``fn_weight=0.8``.
* datasketch: signature time = normalise + split + 3-gram strings + ``MinHash.bulk``; pair
  time = one ``MinHashLSH`` per segment (``insertion_session``), one ``query`` per text, and
  ``MinHash.jaccard >= threshold`` on the candidates (the same verification as ours).

Truth: pairs of one segment whose exact Jaccard of 3-gram sets is ``>= threshold``, computed
over the union of both methods' LSH candidates and the planted pairs only (an all-pairs
exact join would dominate the run). Recall and precision of each final pair set are taken
against that truth.

Synthetic texts: words drawn from a Zipf-like distribution (exponent 1.07) over a random
vocabulary of 20000 words, 150-300 words per text, ``--segments`` namespaces; ``--dup-frac``
of the texts are near-copies of another text with 0-15 words replaced (Jaccard ~0.6-1.0), 90%
in the source's segment and 10% in another one (never a true pair).

Usage::

    .venv/bin/python -m consolidate.bench.minhash_bench --n 2000 20000 --out eval/minhash_bench

Times are the best of ``--repeat`` runs (default 3), after one warm-up call of each method.
Writes ``report.md`` and ``results.json`` to ``--out`` when given. Without datasketch
installed (``pip install datasketch``) it says so and measures ours alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

from consolidate.environment import machine  # noqa: E402
from consolidate.ops.minhash import choose_bands, minhash_signatures, signature_pairs  # noqa: E402
from consolidate.text import normalise  # noqa: E402

K = 3


# ----------------------------------------------------------------------------- data
def make_texts(n: int, dup_frac: float, segments: int, seed: int):
    """``(texts, segment codes int64 [n], planted pairs [(src, copy)])``."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.unique(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(22_000)])[
        :20_000
    ]
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    p /= p.sum()
    n_dup = int(round(n * dup_frac))
    n_base = n - n_dup
    lengths = rng.integers(150, 301, n)
    words = rng.choice(len(vocab), int(lengths.sum()), p=p)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    docs = [words[bounds[t] : bounds[t + 1]].copy() for t in range(n)]
    seg = rng.integers(0, segments, n).astype(np.int64)
    planted = []
    src = rng.integers(0, n_base, n_dup)
    for q in range(n_dup):
        t = n_base + q
        d = docs[src[q]].copy()
        changes = int(rng.integers(0, 16))
        pos = rng.choice(len(d), changes, replace=False)
        d[pos] = rng.choice(len(vocab), changes, p=p)
        docs[t] = d
        if segments > 1 and rng.random() < 0.1:
            seg[t] = (seg[src[q]] + 1 + rng.integers(0, segments - 1)) % segments
        else:
            seg[t] = seg[src[q]]
            planted.append((int(src[q]), t))
    texts = [" ".join(vocab[d]).capitalize() + "." for d in docs]
    order = rng.permutation(n)  # planted copies are not all at the end
    inv = np.argsort(order)
    texts = [texts[o] for o in order]
    planted = [tuple(sorted((int(inv[a]), int(inv[b])))) for a, b in planted]
    return texts, seg[order], planted


def shingle_strings(text: str) -> list[str]:
    """Word 3-grams of ``normalise(text).split()`` as strings (the whole text when shorter
    than 3 words; none when empty): the shingles both methods hash."""
    w = normalise(text).split()
    if not w:
        return []
    if len(w) < K:
        return [" ".join(w)]
    return [" ".join(w[q : q + K]) for q in range(len(w) - K + 1)]


# ----------------------------------------------------------------------------- methods
def run_ours(texts, seg, threshold, num_perm, fn_weight):
    """Time :func:`~consolidate.ops.minhash.minhash_signatures` and
    :func:`~consolidate.ops.minhash.signature_pairs` on ``texts`` (segments ``seg``);
    also every LSH candidate of the same bands, untimed, for the truth set."""
    t0 = time.perf_counter()
    sig = minhash_signatures(texts, num_perm=num_perm, k=K)
    t1 = time.perf_counter()
    i, j, _ = signature_pairs(sig, seg, threshold=threshold, fn_weight=fn_weight)
    t2 = time.perf_counter()
    bands, rows = choose_bands(threshold, num_perm, fn_weight)
    # all LSH candidates (for the truth set; not timed): same bands, no estimate filter
    ci, cj, _ = signature_pairs(sig, seg, threshold=1e-12, bands=bands, max_bucket=None)
    return {
        "sig_s": t1 - t0,
        "pair_s": t2 - t1,
        "total_s": t2 - t0,
        "bands": [bands, rows],
        "pairs": set(zip(i.tolist(), j.tolist(), strict=True)),
        "candidates": set(zip(ci.tolist(), cj.tolist(), strict=True)),
    }


def run_datasketch(texts, seg, threshold, num_perm):
    """Time datasketch's ``MinHash.bulk`` and ``MinHashLSH`` per segment on the same
    shingles and threshold (the baseline)."""
    from datasketch import MinHash, MinHashLSH

    t0 = time.perf_counter()
    shingles = [[s.encode("utf-8") for s in shingle_strings(t)] for t in texts]
    sigs = MinHash.bulk(shingles, num_perm=num_perm, seed=1)
    t1 = time.perf_counter()
    cand = set()
    params = None
    for code in np.unique(seg).tolist():
        idx = np.flatnonzero(seg == code).tolist()
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        params = [lsh.b, lsh.r]
        with lsh.insertion_session() as session:
            for t in idx:
                session.insert(t, sigs[t])
        for t in idx:
            for u in lsh.query(sigs[t]):
                if u != t:
                    cand.add((min(t, u), max(t, u)))
    pairs = {(a, b) for a, b in cand if sigs[a].jaccard(sigs[b]) >= threshold}
    t2 = time.perf_counter()
    return {
        "sig_s": t1 - t0,
        "pair_s": t2 - t1,
        "total_s": t2 - t0,
        "bands": params,
        "pairs": pairs,
        "candidates": cand,
    }


def exact_truth(texts, seg, pairs, threshold):
    """``({pair: exact Jaccard}, truth set)`` over ``pairs``."""
    cache: dict[int, set] = {}

    def sh(t):
        if t not in cache:
            cache[t] = set(shingle_strings(texts[t]))
        return cache[t]

    jac = {}
    for a, b in pairs:
        if seg[a] != seg[b]:
            continue
        x, y = sh(a), sh(b)
        jac[(a, b)] = len(x & y) / len(x | y) if x or y else 1.0
    return jac, {p for p, v in jac.items() if v >= threshold}


def score(found, truth):
    """Recall and precision of the pairs ``found`` against the pairs ``truth`` (sets of
    ``(i, j)``; 1.0 when the denominator is empty)."""
    hit = len(found & truth)
    return {
        "found": len(found),
        "true_found": hit,
        "recall": hit / len(truth) if truth else 1.0,
        "precision": hit / len(found) if found else 1.0,
    }


# ----------------------------------------------------------------------------- main
def bench(n, args, have_ds):
    """One size ``n``: generate texts with planted near-duplicates, run both methods, and
    score them against the planted pairs."""
    t = time.perf_counter()
    texts, seg, planted = make_texts(n, args.dup_frac, args.segments, args.seed)
    words = sum(len(x.split()) for x in texts)
    print(
        f"\nn={n}: {words} words, {len(planted)} planted same-segment pairs "
        f"(generated in {time.perf_counter() - t:.1f}s)",
        flush=True,
    )
    methods = {
        "ours": lambda: run_ours(texts, seg, args.threshold, args.num_perm, 0.5),
        "ours_fn0.8": lambda: run_ours(texts, seg, args.threshold, args.num_perm, 0.8),
    }
    if have_ds:
        methods["datasketch"] = lambda: run_datasketch(texts, seg, args.threshold, args.num_perm)
    runs = {}
    for name, fn in methods.items():  # best of --repeat runs (the outputs are deterministic)
        for _ in range(args.repeat):
            r = fn()
            if name in runs:
                for key in ("sig_s", "pair_s", "total_s"):
                    r[key] = min(r[key], runs[name][key])
            runs[name] = r
    union = set(planted)
    for r in runs.values():
        union |= r["candidates"] | r["pairs"]
    jac, truth = exact_truth(texts, seg, union, args.threshold)
    planted_j = np.array([jac[p] for p in planted])
    out = {
        "n": n,
        "words": words,
        "planted": len(planted),
        "truth_pairs": len(truth),
        "evaluated_pairs": len(jac),
        "planted_jaccard_quantiles": np.quantile(planted_j, [0, 0.25, 0.5, 0.75, 1])
        .round(3)
        .tolist()
        if len(planted_j)
        else [],
        "methods": {},
    }
    for name, r in runs.items():
        cross = sum(seg[a] != seg[b] for a, b in r["pairs"])
        out["methods"][name] = {
            "sig_s": round(r["sig_s"], 3),
            "pair_s": round(r["pair_s"], 3),
            "total_s": round(r["total_s"], 3),
            "bands_rows": r["bands"],
            "candidates": len(r["candidates"]),
            "cross_segment_pairs": int(cross),
            "candidate_recall": len(r["candidates"] & truth) / len(truth) if truth else 1.0,
            **score(r["pairs"], truth),
        }
    if have_ds:
        ds = out["methods"]["datasketch"]
        for name in ("ours", "ours_fn0.8"):
            m = out["methods"][name]
            m["ratio_vs_datasketch"] = {
                key: round(m[key] / ds[key], 4) for key in ("sig_s", "pair_s", "total_s")
            }
    for name, m in out["methods"].items():
        ratio = m.get("ratio_vs_datasketch", {}).get("total_s")
        print(
            f"  {name:11s} sig {m['sig_s']:7.3f}s  pairs {m['pair_s']:7.3f}s  "
            f"total {m['total_s']:7.3f}s  bands {m['bands_rows']}  "
            f"recall {m['recall']:.4f} (LSH {m['candidate_recall']:.4f})  "
            f"precision {m['precision']:.4f}"
            + (f"  ours/ds {ratio:.3f}" if ratio is not None else ""),
            flush=True,
        )
    return out


def report_md(results, args, env) -> str:
    """The Markdown report of ``results`` (one entry per size), with the command and the
    machine."""
    lines = [
        "# MinHash near-exact stage: consolidate.ops.minhash vs datasketch",
        "",
        f"Command: `{env['command']}`",
        "",
        f"Machine: {env['cpus']} CPUs, Python {env['python']}, numpy {env['numpy']}, "
        f"pyarrow {env['pyarrow']}, datasketch {env['datasketch']}. Single process, one "
        "thread of work for both methods.",
        "",
        f"Settings: num_perm={args.num_perm}, threshold={args.threshold}, word {K}-gram "
        f"shingles of normalised texts, {args.segments} segments, dup_frac={args.dup_frac}, "
        f"seed={args.seed}. Times: best of {args.repeat} runs. Truth = same-segment pairs "
        "with exact Jaccard >= threshold among the union of all LSH candidates and the "
        "planted pairs.",
        "",
        "| n | method | bands x rows | signatures s | LSH/pairs s | total s | ours/ds total "
        "| recall | LSH candidate recall | precision | pairs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, m in r["methods"].items():
            ratio = m.get("ratio_vs_datasketch", {}).get("total_s")
            br = "x".join(map(str, m["bands_rows"])) if m["bands_rows"] else "-"
            lines.append(
                f"| {r['n']} | {name} | {br} | {m['sig_s']:.3f} | {m['pair_s']:.3f} | "
                f"{m['total_s']:.3f} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                f"{m['recall']:.4f} | {m['candidate_recall']:.4f} | {m['precision']:.4f} | "
                f"{m['found']} |"
            )
    lines += [
        "",
        "recall: share of true pairs in the final pair set; LSH candidate recall: "
        "share of true pairs that were LSH candidates (before the estimate filter).",
        "",
        "Truth sizes: "
        + ", ".join(
            f"n={r['n']}: {r['truth_pairs']} true pairs of {r['evaluated_pairs']} evaluated, "
            f"planted Jaccard quantiles {r['planted_jaccard_quantiles']}"
            for r in results
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    """Command line (``python -m consolidate.bench.minhash_bench``): both methods at each
    ``--n``; prints and writes the report (``--out``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2_000, 20_000])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--num-perm", type=int, default=128)
    ap.add_argument("--segments", type=int, default=3)
    ap.add_argument("--dup-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="time each method this many times and report the fastest (default 3)",
    )
    args = ap.parse_args(argv)
    try:
        import datasketch

        ds_version = getattr(datasketch, "__version__", "?")
        have_ds = True
    except ImportError:
        print(
            "datasketch is not installed (pip install datasketch): measuring "
            "consolidate.ops.minhash alone",
            file=sys.stderr,
        )
        ds_version, have_ds = "not installed", False
    import pyarrow

    env = {
        "command": "python -m consolidate.bench.minhash_bench " + " ".join(argv or sys.argv[1:]),
        **machine(),
        "numpy": np.__version__,
        "pyarrow": pyarrow.__version__,
        "datasketch": ds_version,
    }
    warm, wseg, _ = make_texts(60, 0.5, 2, 1)  # first-call costs out of the timings
    run_ours(warm, wseg, args.threshold, args.num_perm, 0.5)
    if have_ds:
        run_datasketch(warm, wseg, args.threshold, args.num_perm)
    results = [bench(n, args, have_ds) for n in args.n]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "env": env,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "results": results,
                },
                indent=2,
            )
            + "\n"
        )
        (args.out / "report.md").write_text(report_md(results, args, env))
        print(f"\nwrote {args.out / 'report.md'} and {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
