"""``run_pass``: the offline "sleep" pass as a composition of stages.

A pure function from one snapshot to the next: it reads nothing and writes nothing (the job
loads the snapshot, calls it, commits the result), keeps no global state, and works on one or
many namespaces, so shards of namespaces can run it in any process.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..config import PassConfig, SimilarityConfig
from ..device import resolve_device
from ..ops.merge import ExtractiveMerger, Merger
from ..store.schema import Records
from ..workers import FirstTouch, resolve_workers
from .clock import resolve_now
from .exact import exact_stage
from .long_texts import long_text_stage
from .merging import merge_stage
from .near import cluster_stage, similarity_stage
from .purge import purge_stage
from .reflect import reflect_stage
from .retention import retention_stage
from .state import PassResult, PassState, PassStats, id_ranks

__all__ = ["run_pass"]


def run_pass(
    records: Records,
    *,
    cfg: PassConfig,
    sim_cfg: SimilarityConfig | None = None,
    merger: Merger | None = None,
    version: int = 1,
    wall_h: float | None = None,
    now_by_namespace: dict[str, float] | None = None,
    reflector: Any | None = None,
) -> PassResult:
    """Consolidate ``records`` (one snapshot, any number of namespaces).

    Stages, in order (each timed in ``stats.time_s``): ``purge``
    (:func:`~consolidate.pipeline.purge.purge_stage`), ``exact``
    (:func:`~consolidate.pipeline.exact.exact_stage`), ``similarity``
    (:func:`~consolidate.pipeline.near.similarity_stage`), ``minhash`` (near-exact long
    texts, :func:`~consolidate.pipeline.long_texts.long_text_stage`), ``cluster``
    (:func:`~consolidate.pipeline.near.cluster_stage`), ``merge``
    (:func:`~consolidate.pipeline.merging.merge_stage`), ``reflect``
    (:func:`~consolidate.pipeline.reflect.reflect_stage`, when ``cfg.reflect``) and
    ``score`` (:func:`~consolidate.pipeline.retention.retention_stage`). The vectors are
    moved to the similarity device once and stay there. Pinned records take part in
    nothing but scoring (and are never dropped).

    Args:
        records: all records of the snapshot (tombstones pass through untouched).
        cfg: pass settings (threshold, tau in hours, floor, cap, strength cap, now, stages).
        sim_cfg: similarity engine settings (device, dtype, tiles); default auto fp32.
        merger: the :class:`~consolidate.ops.merge.Merger` (default: extractive).
        version: version of the snapshot this pass will write (stamped as ``last_pass`` and
            mixed into merged ids).
        wall_h: wall clock in hours since the epoch, used for tombstone times and as ``now``
            when ``cfg.now == "wall"`` (default: the current time).
        now_by_namespace: per-namespace "now" in hours since the epoch, overriding
            ``cfg.now`` for the namespaces it names (e.g. the date of a LOCOMO
            conversation's last session, when its questions are asked).
        reflector: writes reflections when ``cfg.reflect`` (an object with
            ``reflect_batch(list[MergeRequest]) -> list[MergeResponse]``, e.g.
            :class:`~consolidate.llm.reflect.LLMReflector`).

    Returns:
        :class:`~consolidate.pipeline.state.PassResult`: the full next record set (live and
        tombstones), the changelog events and the :class:`PassStats`.

    Raises:
        ValueError: bad settings (threshold outside [-1, 1], tau <= 0, cap < 0), a merger
            or reflector that returned the wrong number of responses, or ``cfg.reflect``
            without a reflector.
        MassDropError: more than ``cfg.max_drop_fraction`` of the live memories would be
            dropped (nothing is returned, so nothing can be committed).
    """
    sim_cfg = sim_cfg or SimilarityConfig()
    merger = merger or ExtractiveMerger()
    wall_h = time.time() / 3600 if wall_h is None else float(wall_h)
    check_settings(cfg)
    refresh_now = _now_fn(cfg, wall_h, now_by_namespace)
    with _gc_paused(), _small_pages():  # see both
        return _stages(records, cfg, sim_cfg, merger, reflector, version, wall_h, refresh_now)


def _stages(
    records: Records,
    cfg: PassConfig,
    sim_cfg: SimilarityConfig,
    merger: Merger,
    reflector: Any,
    version: int,
    wall_h: float,
    refresh_now: Callable[[PassState], np.ndarray],
) -> PassResult:
    """:func:`run_pass`'s stages in order, each timed into ``stats.time_s``."""
    times: dict[str, float] = {}

    def timed(name: str, stage: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = stage()
        times[name] = times.get(name, 0.0) + time.perf_counter() - t
        return out

    def with_now(st: PassState) -> PassState:
        st.now = refresh_now(st)  # "latest" depends on the live rows: after every change
        return st

    first = timed("purge", lambda: _start(records, sim_cfg, wall_h, merger.name, version))
    try:
        st = timed("purge", lambda: purge_stage(with_now(first), cfg))
        st.workers = resolve_workers(cfg.text_workers)
        st = timed("exact", lambda: exact_stage(st, cfg))
        st = timed("similarity", lambda: similarity_stage(st, cfg, sim_cfg))
        st = timed("minhash", lambda: long_text_stage(st, cfg))
        st = timed(
            "cluster",
            lambda: cluster_stage(st, cfg, bool(getattr(merger, "handles_conflicts", False))),
        )
        st = timed("merge", lambda: merge_stage(st, cfg, merger, version))
        st.units = st.pairs = None  # unit vectors (as large as the store's) are not needed now
        st = timed(
            "reflect",
            lambda: (
                reflect_stage(with_now(st), cfg, sim_cfg, reflector, version) if cfg.reflect else st
            ),
        )
        st = timed("score", lambda: retention_stage(with_now(st), cfg, version))
        out = timed("score", st.records)
        st.stats.time_s = {k: round(v, 4) for k, v in times.items()}
        return PassResult(out, st.events, st.stats)
    finally:
        # a stage that failed before the exact stage joined the buffer's thread: stop it
        if first.first_touch is not None:
            first.first_touch.join()
            first.first_touch = None


@contextlib.contextmanager
def _gc_paused():  # noqa: ANN202 - a context manager
    """Python's cyclic garbage collector paused while the stages run (and restored after,
    if it was on). The stages allocate millions of small acyclic objects (clauses, sets,
    events), and each allocation burst would otherwise start a collection that walks every
    live object, the text caches included: at 10^5 records in 1,000 namespaces the pass
    took 3.47 s with it and 2.37 s without. Reference counting still frees everything
    acyclic at once; a cycle made during the pass waits for the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _numpy_hugepage(on: bool) -> bool:
    """Set whether NumPy asks for transparent huge pages on its large allocations
    (``madvise(MADV_HUGEPAGE)``); returns the previous setting. A NumPy without the switch
    (it is private API) is left as it is, and the answer is ``False``."""
    setter = getattr(getattr(np, "_core", None), "multiarray", None)
    setter = getattr(setter, "_set_madvise_hugepage", None)
    return bool(setter(on)) if setter is not None else False


@contextlib.contextmanager
def _small_pages():  # noqa: ANN201 - a context manager
    """NumPy's large allocations on ordinary 4 KiB pages while the stages run (the setting
    before is restored after, errors included).

    By default NumPy marks every allocation of 4 MiB or more ``MADV_HUGEPAGE``. Where the
    kernel's THP ``defrag`` setting is ``madvise`` (a common default) and free memory is
    fragmented, each first touch of such a region stalls in direct compaction to assemble a
    2 MiB page. On the 2-core benchmark machine a fresh 77 MB array then took 0.28-0.33 s to
    fill instead of 0.03 s, and the 10^6 pass spent about 1 s of its 12 s there (purge,
    exact and score stages). The pass streams through its arrays once, so huge pages buy it
    little; PyTorch's allocator does not ask for them unless ``THP_MEM_ALLOC_ENABLE`` is
    set."""
    was = _numpy_hugepage(False)
    try:
        yield
    finally:
        if was:
            _numpy_hugepage(True)


def _start(
    records: Records, sim_cfg: SimilarityConfig, wall_h: float, merger: str, version: int
) -> PassState:
    """The initial state: a shallow copy of the row table (pandas copies a column on
    write), the vectors on the pass device (one transfer; no copy on cpu unless rows need
    rescaling, see :func:`_unit_rows`), namespace codes and id ranks."""
    meta = records.meta.copy(deep=False)  # copy-on-write: the caller's frame is never written
    dev = resolve_device(sim_cfg.device)
    with warnings.catch_warnings():
        # a store may hand over read-only vectors (the Lance store compares its commit
        # against them); the pass never writes into this tensor
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        vec = torch.from_numpy(_unit_rows(records.vectors))
    if dev.type != "cpu":
        vec = vec.to(dev)
    ns, names = pd.factorize(meta["namespace"].to_numpy(object), sort=True)
    n = len(meta)
    st = PassState(
        meta=meta,
        vec=vec,
        ns=ns.astype(np.int64),
        ns_names=np.asarray(names, dtype=object),
        id_rank=id_ranks(meta["id"].to_numpy(object)),
        wall_h=wall_h,
        now=np.zeros(n),
        gone=np.zeros(n, bool),
        stats=PassStats(merger=merger, version=version),
        origin=records.origin,
    )
    live = int(st.live().sum())  # at least as many as the exact stage's units
    d = vec.shape[1]
    if dev.type == "cpu" and live * d * 4 >= FIRST_TOUCH_MIN_BYTES:
        # the exact stage's unit vectors go to the spare buffer's first rows: their pages
        # are mapped in on the idle core while the purge stage runs (and, where the
        # thread writes nothing, on while the exact stage fills them from the other end)
        st.spare = torch.empty((n + live, d), dtype=torch.float32)
        st.first_touch = FirstTouch(st.spare.numpy(), live * d * 4)
    return st


#: the unit vectors' bytes from which the pass maps in their buffer in a background thread
#: (:class:`~consolidate.workers.FirstTouch`); below, starting a thread costs more
FIRST_TOUCH_MIN_BYTES = 64 << 20

#: rows further than this from unit length are rescaled by the pass (not in the store)
UNIT_SLACK = 1e-6

#: rows per block of :func:`_unit_rows`' float64 norms
UNIT_BLOCK = 1024

#: rows from which :func:`_unit_rows` shares its blocks out over torch's intra-op threads
UNIT_THREADED_MIN = 1 << 16


def _unit_rows(v: np.ndarray) -> np.ndarray:
    """``float32 [n, d]``: ``v`` itself when every row is a unit vector to within
    :data:`UNIT_SLACK` (no copy), else a copy whose off rows are rescaled in float64.

    Vectors stored as fp16 or bf16 are off unit length by their rounding (up to ~2e-3);
    the clustering's centroid guarantee needs unit vectors, and rescaling them in the store
    would change their stored bits at every nightly re-write, so the pass rescales its own
    copy: its similarities are the cosines of the stored vectors. From
    :data:`UNIT_THREADED_MIN` rows the sums of squares run in torch's intra-op threads, each
    on a contiguous run of blocks (NumPy releases the GIL in them); every row's sum is the
    same as in one thread."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not v.size:
        return v
    sq = np.empty(len(v))

    def sums(lo: int, hi: int) -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            # float64 sums of squares, cast block by block (a block stays in the cache:
            # 0.23 s against 0.36 s for one cast of 10^6 x 384 inside einsum, same sums)
            for a in range(lo, hi, UNIT_BLOCK):
                b = v[a : min(a + UNIT_BLOCK, hi)].astype(np.float64)
                np.einsum("ij,ij->i", b, b, out=sq[a : min(a + UNIT_BLOCK, hi)])

    threads = min(torch.get_num_threads(), -(-len(v) // UNIT_THREADED_MIN))
    if threads > 1:
        cuts = np.linspace(0, len(v), threads + 1).astype(np.int64).tolist()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(sums, cuts[:-1], cuts[1:]))
    else:
        sums(0, len(v))
    off = np.flatnonzero(np.isfinite(sq) & (sq > 0) & (np.abs(np.sqrt(sq) - 1) > UNIT_SLACK))
    if not len(off):
        return v
    out = v.copy()
    out[off] = (v[off].astype(np.float64) / np.sqrt(sq[off])[:, None]).astype(np.float32)
    return out


def _now_fn(
    cfg: PassConfig, wall_h: float, now_by_namespace: dict[str, float] | None
) -> Callable[[PassState], np.ndarray]:
    """``f(state) -> float64 [n]``: "now" per row for ``cfg.now``, with the per-namespace
    overrides; recomputed after stages that add or remove live rows ("latest" depends on
    them)."""
    over = now_by_namespace or None

    def now(st: PassState) -> np.ndarray:
        t = resolve_now(cfg.now, st.meta, wall_h, st.ns)
        if over:
            o = pd.Series(st.ns_names).map(over).to_numpy(np.float64)[st.ns]
            t = np.where(np.isnan(o), t, o)
        return t

    return now


def check_settings(cfg: PassConfig) -> None:
    """Refuse settings that would silently do the wrong thing (NaN compares false); the jobs
    call it before any work, :func:`run_pass` again.

    Raises:
        ValueError: the first setting out of range (in the order of :data:`_SETTINGS`),
            named as its ``sleep.*`` key.
    """
    for key, ok, what in _SETTINGS:
        value = getattr(cfg, key)
        if not ok(value):
            raise ValueError(f"sleep.{key} must be {what}, got {value!r}")


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _now_ok(now: Any) -> bool:
    """``sleep.now`` is ``wall``, ``latest``, or a time :func:`resolve_now` reads (which
    raises naming the setting otherwise); a number must be finite."""
    if isinstance(now, str) and now in ("wall", "latest"):
        return True
    from .clock import resolve_now

    resolve_now(now, pd.DataFrame({"namespace": []}), 0.0)  # raises naming sleep.now
    try:
        return math.isfinite(float(now))
    except (TypeError, ValueError):
        return True  # an ISO time


#: ``(setting, test, what it must be)`` of each pass setting :func:`check_settings` checks
_SETTINGS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("threshold", lambda x: _real(x) and -1.0 <= x <= 1.0, "in [-1, 1]"),
    ("tau_hours", lambda x: _real(x) and x > 0, "> 0 hours"),
    ("floor", lambda x: _real(x) and 0.0 <= x <= 1.0, "in [0, 1]"),
    ("cap", lambda x: x is None or _int(x, 0), "an integer >= 0 or null"),
    ("strength_cap", lambda x: _real(x) and x >= 1, ">= 1"),
    ("max_namespace_drop_fraction", lambda x: _real(x) and 0.0 <= x <= 1.0, "in [0, 1]"),
    ("now", _now_ok, "finite"),
    ("namespace_stop_min_live", lambda x: _int(x, 1), "an integer >= 1"),
    ("max_drop_fraction", lambda x: _real(x) and 0.0 <= x <= 1.0, "in [0, 1]"),
    ("reflect_threshold", lambda x: _real(x) and -1.0 <= x <= 1.0, "in [-1, 1]"),
    ("minhash_min_chars", lambda x: x is None or _int(x, 1), "an integer >= 1 or null"),
    ("minhash_threshold", lambda x: _real(x) and 0.0 < x <= 1.0, "in (0, 1]"),
    (
        "protect_importance",
        lambda x: x is None or (_real(x) and 0.0 <= x <= 1.0),
        "in [0, 1] or null",
    ),
    ("fidelity", lambda x: x in ("refuse", "report"), "refuse or report"),
    ("fidelity_threshold", lambda x: _real(x) and 0.0 < x <= 1.0, "in (0, 1]"),
    ("reflect_min_size", lambda x: _int(x, 1), "an integer >= 1"),
    ("reflect_max_per_namespace", lambda x: _int(x, 1), "an integer >= 1"),
    ("text_workers", lambda x: x is None or _int(x, 1), "an integer >= 1 or null"),
)
