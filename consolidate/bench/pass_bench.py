#!/usr/bin/env python3
"""Whole-pass benchmark children: a synthetic store generator and the measuring run.

``consolidate-bench`` (:mod:`consolidate.bench.benchmark`, the parent) starts each step in its own process so that the peak
resident memory (``VmHWM``) of the measuring process holds only what the job itself holds:

* ``pass_bench.py generate SPEC_JSON``: builds the synthetic store (:func:`make_pass_store`)
  and writes it as a real store (``Store.create``) into ``SPEC["out"]``; prints one JSON
  line (what was planted, vector and text bytes, times).
* ``pass_bench.py measure SPEC_JSON``: ``Store.load`` -> ``run_pass`` -> ``store.commit``
  (under ``store.lock()``) on the store in ``SPEC["store"]``; prints one JSON line (times,
  per-stage times, counts, ``VmHWM`` before and after the pass).

The package measured is the one found first on ``sys.path``: the repository's by default, or
the folder in the environment variable ``PASS_BENCH_PKG`` (an exported older revision, the
baseline); the JSON says which file was imported.

Everything but JSON goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: the folder holding the ``consolidate`` package (a checkout or site-packages)
REPO = Path(__file__).resolve().parents[2]
PKG_ENV = "PASS_BENCH_PKG"

# ----------------------------------------------------------------------------- texts
# Paraphrases differ by words only: no digits, number words, month/weekday/relative-time
# words or negations anywhere, so the conflict guard sees nothing between cluster members.
SUBJECTS = [
    "user",
    "the user",
    "my sister",
    "my brother",
    "her friend",
    "his partner",
    "our neighbour",
    "the manager",
    "my cousin",
    "the teacher",
    "my colleague",
    "her mother",
    "his father",
    "the student",
    "my roommate",
    "the coach",
]
VERBS = [  # each row: interchangeable verbs (cluster member k uses column k)
    ["likes", "enjoys", "loves", "adores", "is fond of"],
    ["collects", "gathers", "keeps", "hoards", "stores"],
    ["buys", "purchases", "orders", "picks up", "gets"],
    ["cooks", "prepares", "makes", "fixes", "puts together"],
    ["paints", "draws", "sketches", "illustrates", "depicts"],
    ["reads about", "studies", "researches", "learns about", "looks into"],
    ["talks about", "chats about", "discusses", "mentions", "brings up"],
    ["shares", "gives away", "passes around", "hands out", "offers"],
]
ADJECTIVES = [
    "green",
    "red",
    "blue",
    "yellow",
    "purple",
    "orange",
    "fresh",
    "spicy",
    "sweet",
    "smoky",
    "crunchy",
    "soft",
    "vintage",
    "handmade",
    "tiny",
    "huge",
    "fancy",
    "simple",
    "rare",
    "local",
    "organic",
    "bright",
    "dark",
    "wooden",
]
OBJECTS = [
    "tea",
    "coffee",
    "bread",
    "cookies",
    "pasta",
    "soup",
    "salad",
    "cheese",
    "apples",
    "berries",
    "noodles",
    "dumplings",
    "pancakes",
    "muffins",
    "curry",
    "rice",
    "paintings",
    "postcards",
    "stamps",
    "records",
    "books",
    "comics",
    "plants",
    "flowers",
    "candles",
    "mugs",
    "scarves",
    "hats",
    "puzzles",
    "maps",
    "shells",
    "stones",
    "kites",
    "lamps",
    "pillows",
    "blankets",
    "sneakers",
    "jackets",
    "bowls",
    "spoons",
]
PLACES = [
    "in the garden",
    "at the park",
    "in the kitchen",
    "at the market",
    "by the lake",
    "at the cafe",
    "in the library",
    "at the beach",
    "in the studio",
    "at home",
    "at the office",
    "in the city",
    "at the festival",
    "in the mountains",
    "on the balcony",
    "at the museum",
    "near the river",
    "in the village",
    "at the gym",
    "on the train",
    "at school",
    "in the forest",
    "at the bakery",
    "in the attic",
    "on the porch",
    "at the harbour",
    "in the basement",
    "at the fair",
    "in the yard",
    "at the shop",
]
MAX_CLUSTER = len(VERBS[0])  # cluster sizes 2..5: one verb of its row per member
_RADIX = (len(SUBJECTS), len(VERBS), len(ADJECTIVES), len(OBJECTS), len(PLACES))
TEXT_COMBOS = math.prod(_RADIX)  # 3,686,400 distinct base sentences
_MULT = 1_000_003  # prime, coprime to TEXT_COMBOS (2^a 3^b 5^c): entity -> combo is 1:1


def texts_for(entity: np.ndarray, variant: np.ndarray, seed: int) -> list[str]:
    """One sentence per row: ``entity`` picks the sentence (distinct entities, distinct
    sentences, up to :data:`TEXT_COMBOS`), ``variant`` (0..4) the verb of its verb row."""
    combo = (entity.astype(np.int64) * _MULT + seed * 7919) % TEXT_COMBOS
    digits = []
    for r in reversed(_RADIX):
        digits.append(combo % r)
        combo = combo // r
    place, obj, adj, vrow, subj = digits
    verbs = np.array([v for row in VERBS for v in row], dtype=object)
    cols = (
        np.array(SUBJECTS, dtype=object)[subj],
        verbs[vrow * MAX_CLUSTER + variant],
        np.array(ADJECTIVES, dtype=object)[adj],
        np.array(OBJECTS, dtype=object)[obj],
        np.array(PLACES, dtype=object)[place],
    )
    return [f"{a} {b} {c} {d} {e}" for a, b, c, d, e in zip(*cols, strict=True)]


# ----------------------------------------------------------------------------- store


def _unit_rows(rng: np.random.Generator, n: int, d: int, chunk: int = 65_536) -> np.ndarray:
    v = np.empty((n, d), np.float32)
    for r0 in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - r0), d), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        v[r0 : r0 + len(x)] = x
    return v


def default_clusters(ns_size: int, near_frac: float = 0.1) -> int:
    """Planted clusters per namespace so that about ``near_frac`` of its rows are in one
    (sizes 2..5, mean 3.5)."""
    return max(1, round(near_frac * ns_size / 3.5))


def make_pass_store(
    n: int,
    ns_size: int,
    *,
    d: int = 384,
    seed: int = 0,
    clusters_per_ns: int | None = None,
    dup_frac: float = 0.02,
    cos: tuple[float, float] = (0.935, 0.985),
    now_h: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """A synthetic store as :class:`consolidate.store.schema.Records` and what was planted.

    ``n / ns_size`` namespaces of ``ns_size`` rows each; float32 unit vectors of dimension
    ``d``. In each namespace: ``clusters_per_ns`` near-duplicate clusters of 2..5 members
    (default: about 10% of its rows), each member ``normalise(base + noise)`` with the noise
    of the cluster set so that members' cosines are about a value drawn from ``cos`` (above
    a 0.9 threshold), texts that are paraphrases of one sentence (one verb swapped for
    another); ``round(dup_frac * ns_size)`` exact duplicates (the text and vector of another
    row of the namespace); every other row a random unit vector (cosine about 0 to the
    rest) with a sentence of its own. Rows are shuffled across namespaces. created_at and
    last_used lie in the 30 days before ``now_h``, importance uniform in [0.2, 1],
    strength 1.

    Deterministic for a ``seed`` (times up to ``now_h``, default the clock).
    """
    from consolidate.store.schema import Records

    if n % ns_size:
        raise ValueError(f"n={n} is not a multiple of the namespace size {ns_size}")
    rng = np.random.default_rng(seed)
    n_ns, m = n // ns_size, ns_size
    c = default_clusters(m) if clusters_per_ns is None else int(clusters_per_ns)
    lay = _Layout.draw(rng, n_ns, m, c, round(dup_frac * m))
    v = _planted_vectors(rng, n, d, cos, lay)

    # text of a row: its own entity (a sentence), a cluster's entity with the member's verb,
    # or a duplicate's source's text
    entity = np.arange(n, dtype=np.int64)
    variant = np.zeros(n, np.int64)
    entity[lay.member_rows] = n + lay.member_cl  # ids above n: never another row's sentence
    variant[lay.member_rows] = lay.member_k
    entity[lay.dup_rows] = entity[lay.src_rows]
    n_cl = lay.csize.size
    if n + n_cl > TEXT_COMBOS:
        raise ValueError(f"n={n}: more sentences needed than the vocabulary has")
    ns_code = np.arange(n, dtype=np.int64) // m
    perm = rng.permutation(n)
    v = v[perm]
    entity, variant, ns_code = entity[perm], variant[perm], ns_code[perm]
    texts = texts_for(entity, variant, seed)
    meta = _bench_meta(rng, texts, ns_code, n_ns, now_h)
    cluster_rows = int(lay.csize.sum())
    info = {
        "n": n,
        "d": d,
        "ns_size": m,
        "namespaces": n_ns,
        "clusters_per_ns": c,
        "planted_clusters": int(n_cl),
        "cluster_rows": cluster_rows,
        "duplicate_rows": int(lay.dup_rows.size),
        "duplicate_groups": int(np.unique(lay.src_rows).size),
        # what a pass that finds exactly the planted structure leaves live
        "expected_out": int(n - lay.dup_rows.size - cluster_rows + n_cl),
        "vector_bytes": int(v.nbytes),
        "text_bytes": int(sum(len(t.encode()) for t in texts)),
        "seed": seed,
    }
    return Records(meta, v), info


@dataclass
class _Layout:
    """Where :func:`make_pass_store` plants its structure, as row positions before the
    shuffle: clusters (start and size of each; each member's row, cluster and place in it),
    exact duplicates and the rows they copy."""

    cstart: np.ndarray
    csize: np.ndarray
    member_rows: np.ndarray
    member_cl: np.ndarray
    member_k: np.ndarray
    dup_rows: np.ndarray
    src_rows: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, n_ns: int, m: int, c: int, dups: int) -> _Layout:
        """``c`` clusters of 2..:data:`MAX_CLUSTER` rows and ``dups`` duplicates in each of
        ``n_ns`` namespaces of ``m`` rows: rows ``[ns*m, ns*m + in_clusters)`` the
        clusters, then the duplicates, then the rest (the duplicates' sources among them).

        Raises:
            ValueError: they do not fit in ``m`` rows.
        """
        sizes = rng.integers(2, MAX_CLUSTER + 1, size=(n_ns, c))
        in_clusters = sizes.sum(1)
        if (in_clusters + dups >= m).any():
            raise ValueError(
                f"{c} clusters of up to {MAX_CLUSTER} and {dups} duplicates do not "
                f"fit in namespaces of {m} rows"
            )
        ns_base = np.arange(n_ns, dtype=np.int64)[:, None] * m
        cstart = (ns_base + np.cumsum(sizes, 1) - sizes).ravel()
        csize = sizes.ravel()
        first = np.repeat(np.cumsum(csize) - csize, csize)
        member_k = np.arange(int(csize.sum())) - first
        free = (m - in_clusters - dups)[:, None]
        src_rows = (
            ns_base
            + in_clusters[:, None]
            + dups
            + np.floor(rng.random((n_ns, dups)) * free).astype(np.int64)
        ).ravel()
        return cls(
            cstart=cstart,
            csize=csize,
            member_rows=np.repeat(cstart, csize) + member_k,
            member_cl=np.repeat(np.arange(csize.size), csize),
            member_k=member_k,
            dup_rows=(ns_base + in_clusters[:, None] + np.arange(dups)[None, :]).ravel(),
            src_rows=src_rows,
        )


def _planted_vectors(
    rng: np.random.Generator, n: int, d: int, cos: tuple[float, float], lay: _Layout
) -> np.ndarray:
    """``float32 [n, d]`` unit vectors: random rows, each cluster's members its first row
    plus noise scaled for a cosine drawn from ``cos``, each duplicate its source's vector."""
    v = _unit_rows(rng, n, d)
    u = 1.0 / rng.uniform(*cos, size=lay.csize.size) - 1.0  # |noise|^2: cosine ~ 1 / (1 + u)
    scale = np.sqrt(u / d).astype(np.float32)
    base = v[lay.cstart].copy()
    for r0 in range(0, lay.member_rows.size, 65_536):
        rows, cl = lay.member_rows[r0 : r0 + 65_536], lay.member_cl[r0 : r0 + 65_536]
        x = base[cl] + scale[cl, None] * rng.standard_normal((rows.size, d), dtype=np.float32)
        v[rows] = x / np.linalg.norm(x, axis=1, keepdims=True)
    v[lay.dup_rows] = v[lay.src_rows]
    return v


def _bench_meta(
    rng: np.random.Generator,
    texts: list[str],
    ns_code: np.ndarray,
    n_ns: int,
    now_h: float | None,
) -> Any:
    """The store columns of the benchmark rows (shuffled): random ids, times in the 30
    days before ``now_h`` (default: the clock), importance uniform in [0.2, 1]."""
    import pandas as pd

    from consolidate.store.schema import COLUMNS, hours_now
    from consolidate.text import text_hash

    n = len(texts)
    id_num = rng.permutation(n)
    ids = [f"mem-{x:08x}" for x in id_num]
    ns_names = np.array([f"ns{k:06d}" for k in range(n_ns)], dtype=object)
    now = hours_now() - 0.1 if now_h is None else float(now_h)
    created = now - rng.uniform(0, 720, n)
    last_used = created + rng.uniform(0, 1, n) * (now - created)
    nan = np.full(n, np.nan)
    hashes = {t: text_hash(t) for t in set(texts)}

    def empty_lists() -> pd.Series:
        return pd.Series([[] for _ in range(n)], dtype=object)

    cols = {
        "id": pd.Series(ids, dtype=object),
        "namespace": pd.Series(ns_names[ns_code], dtype=object),
        "text": pd.Series(texts, dtype=object),
        "importance": rng.uniform(0.2, 1.0, n),
        "created_at": created,
        "last_used": last_used,
        "strength": np.ones(n),
        "pinned": np.zeros(n, bool),
        "source_ids": empty_lists(),
        "valid_from": nan,
        "valid_to": nan.copy(),
        "deleted_at": nan.copy(),
        "deleted_reason": pd.Series([None] * n, dtype=object),
        "merged_into": pd.Series([None] * n, dtype=object),
        "text_hash": pd.Series([hashes[t] for t in texts], dtype=object),
        "last_pass": nan.copy(),
        "keep_apart": empty_lists(),
        "derived_from": empty_lists(),
    }
    meta = pd.DataFrame({c: cols[c] for c in COLUMNS})
    for col, dt in COLUMNS.items():
        if str(meta[col].dtype) != dt:
            meta[col] = meta[col].astype(dt)
    return meta


# ----------------------------------------------------------------------------- measuring


def _proc_status(key: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRSS:
    """Peak resident memory (``VmRSS``, bytes) of this process while the block runs, sampled
    every ``every_s`` seconds and at both ends: a block's own peak, which ``VmHWM`` hides
    when something before it peaked higher. The one RSS sampler of the benchmarks (this
    module imports nothing of the package, so it also measures an older revision).

    Attributes:
        peak: the highest sample, bytes (0 where ``/proc`` is missing).
    """

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.peak = 0

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, _proc_status("VmRSS"))

    def __enter__(self) -> PeakRSS:
        self.peak = _proc_status("VmRSS")
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _proc_status("VmRSS"))


def _use_package() -> str:
    """Put the package to measure first on ``sys.path`` and import it. An editable install's
    finder (which maps ``consolidate.*`` to the working tree even below a package imported
    from elsewhere) is removed when another folder is asked for: a module that the older
    package lacks must fail to import, not come from the working tree."""
    root = os.environ.get(PKG_ENV) or str(REPO)
    if os.environ.get(PKG_ENV):
        sys.meta_path[:] = [
            f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
        ]
    sys.path.insert(0, root)
    import consolidate

    _check_modules(root)
    return str(Path(consolidate.__file__).resolve())


def _check_modules(root: str) -> None:
    """Raise if a loaded ``consolidate`` module comes from outside ``root``."""
    base = str(Path(root).resolve()) + os.sep
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if (
            (name == "consolidate" or name.startswith("consolidate."))
            and f
            and not str(Path(f).resolve()).startswith(base)
        ):
            raise RuntimeError(f"{name} was imported from {f}, not from {root}")


def _stat(stats: Any, key: str) -> Any:
    """``stats[key]`` of a dict or of a dataclass that supports ``[]`` (or its attribute)."""
    try:
        val = stats[key]
    except (KeyError, TypeError, IndexError):
        val = getattr(stats, key, None)
    if isinstance(val, np.generic):
        val = val.item()
    return val


def _gb(b: float) -> float:
    return round(b / 2**30, 4)


def _filtered(cls: Any, kw: dict[str, Any]) -> Any:
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``generate`` child: build the case's synthetic store (``spec``: n, namespace
    size, d, seed, layout, store path) with the package under test and write it; returns
    its facts (planted clusters, expected output, vector and text bytes)."""
    pkg = _use_package()
    from consolidate.store import Store

    t = time.perf_counter()
    recs, info = make_pass_store(
        spec["n"],
        spec["ns_size"],
        d=spec.get("d", 384),
        seed=spec.get("seed", 0),
        clusters_per_ns=spec.get("clusters_per_ns"),
    )
    info["generate_s"] = round(time.perf_counter() - t, 3)
    print(
        f"   generated n={info['n']} ({info['generate_s']:.1f} s), writing the store",
        file=sys.stderr,
        flush=True,
    )
    t = time.perf_counter()
    Store(spec["out"]).create(recs, source="pass-benchmark")
    info["create_s"] = round(time.perf_counter() - t, 3)
    info["store_bytes"] = int(
        sum(p.stat().st_size for p in Path(spec["out"]).rglob("*") if p.is_file())
    )
    info["package"] = pkg
    return info


def _resolved_device(stats: Any, want: str) -> str:
    dev = _stat(stats, "device")
    if isinstance(dev, str) and dev:
        return "cuda" if dev.startswith("cuda") else dev
    import torch

    return "cuda" if want != "cpu" and torch.cuda.is_available() else "cpu"


#: the pass's counts each measurement reports
_STATS = (
    "records_in",
    "records_out",
    "pairs",
    "clusters",
    "merges",
    "exact_merges",
    "exact_groups",
    "merged_members",
    "review_pairs",
    "engine",
)


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the pass's forked workers)."""
    t = os.times()
    return t.children_user + t.children_system


def _workers_private() -> int:
    """The most private memory one forked worker of the pass held (bytes; 0 for a package
    without :mod:`consolidate.workers`)."""
    try:
        from consolidate.workers import peak_private_bytes
    except ImportError:
        return 0
    return peak_private_bytes()


def _pass_configs(spec: dict[str, Any]) -> tuple[Any, Any]:
    """``(PassConfig, SimilarityConfig)`` of a measurement: ``spec``'s threshold (0.9),
    device and dtype, no cap and no mass-drop stop (fields the measured package lacks are
    left out, :func:`_filtered`)."""
    from consolidate.config import PassConfig, SimilarityConfig

    cfg = _filtered(
        PassConfig,
        {
            "threshold": spec.get("threshold", 0.9),
            "cap": None,
            "max_drop_fraction": 1.0,
            "max_namespace_drop_fraction": 1.0,
        },
    )
    sim_cfg = _filtered(
        SimilarityConfig, {"device": spec.get("device", "cpu"), "dtype": spec.get("dtype", "fp32")}
    )
    return cfg, sim_cfg


def _rusage() -> tuple[float, float]:
    """``(kernel cpu s, minor page faults)`` of this process so far (both NaN where the
    ``resource`` module is missing: not measured, rather than none)."""
    try:
        import resource
    except ImportError:
        return math.nan, math.nan
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return float(ru.ru_stime), float(ru.ru_minflt)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One whole-pass measurement in this process (a child of the benchmark, with the package
    ``spec`` names on its path): load the store at ``spec["store"]``, warm up on a slice,
    time the pass and the commit, sample the peak RSS; returns the times, memory and counts."""
    pkg = _use_package()
    from consolidate.store import Store

    try:
        from consolidate.pipeline import run_pass
    except ImportError:
        from consolidate.sleep import run_pass
    _check_modules(os.environ.get(PKG_ENV) or str(REPO))
    cfg, sim_cfg = _pass_configs(spec)
    out: dict[str, Any] = {
        "package": pkg,
        "run_pass": f"{run_pass.__module__}.run_pass",
        "hwm_start_gb": _gb(_proc_status("VmHWM")),
    }
    store = Store(spec["store"])
    t = time.perf_counter()
    snap = store.load()
    out["load_s"] = round(time.perf_counter() - t, 4)
    # untimed warm-up on a slice (first calls: thread pools, CUDA context, kernel compiles)
    warm = spec.get("warm_rows", 2000)
    if warm:
        t = time.perf_counter()
        run_pass(
            snap.records.take(np.arange(min(warm, len(snap.records)))),
            cfg=cfg,
            sim_cfg=sim_cfg,
            version=snap.version + 1,
        )
        out["warmup_s"] = round(time.perf_counter() - t, 4)
    out["hwm_before_gb"] = _gb(_proc_status("VmHWM"))
    out["rss_before_gb"] = _gb(_proc_status("VmRSS"))
    print(
        f"   loaded {len(snap.records)} records ({out['load_s']:.1f} s), running the pass",
        file=sys.stderr,
        flush=True,
    )
    with PeakRSS(every_s=0.05) as sampler:
        t, c, kids = time.perf_counter(), time.process_time(), _children_cpu_s()
        ru = _rusage()
        res = run_pass(snap.records, cfg=cfg, sim_cfg=sim_cfg, version=snap.version + 1)
        out["pass_s"] = round(time.perf_counter() - t, 4)
        out["pass_cpu_s"] = round(time.process_time() - c, 4)
        # kernel time (page faults, forks) and minor page faults of this process in the pass
        ru2 = _rusage()
        out["pass_sys_s"] = round(ru2[0] - ru[0], 4)
        faults = ru2[1] - ru[1]
        out["pass_minor_faults"] = int(faults) if math.isfinite(faults) else math.nan
        # forked text workers (consolidate.workers): their CPU time and own memory
        out["workers_cpu_s"] = round(_children_cpu_s() - kids, 4)
    out["workers_private_gb"] = _gb(_workers_private())
    out["load1"] = os.getloadavg()[0]
    out["hwm_after_gb"] = _gb(_proc_status("VmHWM"))
    out["pass_sampled_peak_gb"] = _gb(sampler.peak)
    t = time.perf_counter()
    with store.lock():
        done = store.commit(res.records, res.events, base=snap)
    out["commit_s"] = round(time.perf_counter() - t, 4)
    out["hwm_commit_gb"] = _gb(_proc_status("VmHWM"))
    _check_modules(os.environ.get(PKG_ENV) or str(REPO))  # lazy imports too
    st = res.stats
    out["stages"] = {str(k): float(v) for k, v in dict(_stat(st, "time_s") or {}).items()}
    out.update({key: _stat(st, key) for key in _STATS})
    out["device"] = _resolved_device(st, sim_cfg.device)
    out["events"] = len(res.events)
    out["version"] = done.get("version") if isinstance(done, dict) else None
    return out


def main(argv: list[str]) -> int:
    """Command line of a child process: ``generate SPEC`` or ``measure SPEC`` (``SPEC`` a
    JSON object); prints the result as one JSON line (``ok`` false with the error when it
    failed). Returns the exit code."""
    if len(argv) != 2 or argv[0] not in ("generate", "measure"):
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    try:
        res = (generate if argv[0] == "generate" else measure)(spec)
        res["ok"] = True
    except Exception as e:  # the parent records the error as the case's result
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(res, default=str), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
