"""Fleet runs: the sleep pass over a Lance store's namespaces, in shards, on Ray Data.

The pass (:func:`~consolidate.pipeline.run_pass`) is a pure function of one snapshot, and
every stage works within a namespace, so whole namespaces can run anywhere. A fleet run:

1. **plans** (driver): reads the ``namespace`` column of the pinned version (never the
   vectors or texts), groups namespaces that share a pending delta file (so each delta is
   applied by exactly one shard), and packs whole namespaces into shards of about
   ``runner.max_rows_per_shard`` rows;
2. **reads** (Ray Data): a datasource with one read task per shard, each a filtered Lance
   scan of its namespaces at the pinned version, so every block holds whole namespaces and
   no group-by shuffle is needed;
3. **runs the pass** (Ray actors, ``runner.actors`` of them, CPUs or GPUs each): decodes and
   validates the shard's rows, applies its pending deltas, runs the pass and returns only
   what changed (:meth:`~consolidate.store.lance.LanceStore.changes`), its events and
   its stats;
4. **answers merges** (optional, ``runner.llm=ray_data``): the actors' LLM merger asks
   instead of calling a model; the driver sends the requests of every shard through one
   Ray Data stage, ``ray.data.llm``'s vLLM processor, and the shards that asked run again
   with the answers (rounds: first answers, then retries);
5. **commits** (driver): the store-wide safety stop over the shards' drops, then a Lance
   version holding their changes
   (:meth:`~consolidate.store.lance.LanceStore.commit_changes`): one for the run, or
   with ``runner.shards_per_commit=k`` one for every ``k`` shards done, so that a failed
   shard costs only its own work.

The driver never holds the store's rows, only the changed ones. The records a fleet run
commits are those of a single-process pass over the same namespaces (tested). Deltas that
name ids in namespaces outside the run stay pending, as with a single-process partial load.

Ray is imported only when a fleet run starts (``pip install "ray[data]"``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from .config import PassConfig, RunnerConfig, SimilarityConfig
from .pipeline.retention import mass_drop_error
from .pipeline.state import PassStats
from .store.lance import LanceStore
from .store.lance.dataset import _MAX_CHAIN
from .store.lance.scan import _read_table
from .store.lance.shards import read_shard

__all__ = ["FleetPlan", "plan_shards", "run_fleet_pass"]

log = logging.getLogger("consolidate")

#: rounds of shard passes at most when an LLM stage answers the merges (an LLMMerger asks
#: twice, first answers then retries: three rounds; one more is never needed)
_MAX_ROUNDS = 4

#: PassStats fields that are not summed over shards
_NOT_SUMMED = {"merger", "version", "device", "engine", "score_min", "time_s"}


@dataclass
class FleetPlan:
    """The shards of one fleet run.

    Attributes:
        version: the Lance version every shard reads.
        shards: namespaces per shard (sorted within a shard; shards ordered by their first
            namespace).
        rows: stored rows per shard (``int64 [n_shards]``).
        deltas: pending delta files each shard applies.
        left_pending: pending delta files no shard applies (they name ids outside the
            run's namespaces, or ids not stored); they stay pending.
    """

    version: int
    shards: list[list[str]]
    rows: np.ndarray
    deltas: list[list[str]]
    left_pending: list[str]


def plan_shards(
    store: LanceStore,
    *,
    version: int,
    pending: Sequence[str],
    namespaces: Sequence[str] | None,
    max_rows: int,
) -> FleetPlan:
    """Pack whole namespaces into shards for :func:`run_fleet_pass`.

    Reads only the ``namespace`` column of ``version`` (and ``id``, ``namespace`` of the rows
    the pending deltas name, through the ``id`` index).

    Args:
        store: the Lance store.
        version: the version to read.
        pending: the pending delta files (:meth:`LanceStore.pending`).
        namespaces: the namespaces to run (``None``: every namespace).
        max_rows: rows per shard at most (>= 1): namespaces (and the groups of them that
            one delta binds) are packed in order while a shard stays within it; one larger
            than ``max_rows`` gets a shard of its own.

    Returns:
        :class:`FleetPlan`.

    Raises:
        ValueError: ``max_rows`` < 1.
        CorruptStoreError: the version or a delta file cannot be read.
    """
    if not (isinstance(max_rows, int) and max_rows >= 1):
        raise ValueError(f"runner.max_rows_per_shard must be an integer >= 1, got {max_rows!r}")
    ns_col = store.read_rows(version, namespaces, columns=["namespace"]).column("namespace")
    counts = ns_col.value_counts()
    names = np.asarray(counts.field("values").to_pylist(), dtype=object)
    rows = counts.field("counts").to_numpy().astype(np.int64)
    order = np.argsort(names.astype(str), kind="stable")
    names, rows = names[order], rows[order]
    ids_of = {name: store.delta_ids(name) for name in pending}
    comp, applied, left = _bind_deltas(
        ids_of, _delta_reach(store, version, ids_of), names, namespaces is not None
    )
    shards, shard_rows, ns_shard = _pack(names, rows, comp, max_rows)
    deltas: list[list[str]] = [[] for _ in range(len(shards))]
    for name, at in applied.items():  # a delta that reaches no stored row: the first shard
        deltas[int(ns_shard[at[0]]) if at else 0].append(name)
    return FleetPlan(version, shards, shard_rows, deltas, sorted(left))


def _delta_reach(
    store: LanceStore, version: int, ids_of: dict[str, list[str]]
) -> dict[str, tuple[str | None, str | None]]:
    """``{id: (namespace, merged_into)}`` of every record a delta's replay reads: the ids the
    deltas name and where their ``merged_into`` chains lead (a touch of a merged record
    lands on the record it was merged into); ``(None, None)`` for an id not stored. One
    filtered read of the id index per link followed."""
    where: dict[str, tuple[str | None, str | None]] = {}
    frontier = sorted({i for ids in ids_of.values() for i in ids})
    ds = store._open(version)
    for _ in range(_MAX_CHAIN):
        frontier = [i for i in frontier if i not in where]
        if not frontier:
            break
        t, _ = _read_table(
            ds, columns=["id", "namespace", "merged_into"], filter=pc.field("id").isin(frontier)
        )
        got = dict(
            zip(
                t.column("id").to_pylist(),
                zip(
                    t.column("namespace").to_pylist(),
                    t.column("merged_into").to_pylist(),
                    strict=True,
                ),
                strict=True,
            )
        )
        where.update({i: got.get(i, (None, None)) for i in frontier})
        frontier = [m for _, m in got.values() if isinstance(m, str)]
    return where


def _bind_deltas(
    ids_of: dict[str, list[str]],
    where: dict[str, tuple[str | None, str | None]],
    names: np.ndarray,
    partial: bool,
) -> tuple[np.ndarray, dict[str, list[int]], list[str]]:
    """Namespaces that share a delta file go into one shard: a union-find over the deltas
    (as many as the writes since the last pass, not the records).

    Returns:
        ``(comp, applied, left)``: ``int64 [n]`` a component root per namespace of ``names``;
        per delta replayed, the positions of the namespaces it reaches; the deltas left
        pending (they name an id not stored, in a ``partial`` run, or reach a namespace
        outside the run).
    """
    n = len(names)
    parent = np.arange(n)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    pos = pd.Index(names)
    applied: dict[str, list[int]] = {}
    left = []
    for name, ids in ids_of.items():
        reach: set[str] = set()
        unknown = False
        for i in ids:
            for _ in range(_MAX_CHAIN):
                ns, nxt = where.get(i, (None, None))
                if ns is None:
                    unknown = True
                    break
                reach.add(ns)
                if not isinstance(nxt, str):
                    break
                i = nxt
        at = pos.get_indexer(sorted(reach))
        # ids not stored are ignored by a replay over the whole store, as by a load; a run
        # over some namespaces leaves such a delta pending, as a partial load does
        if (at < 0).any() or (unknown and partial) or (not len(at) and not n):
            left.append(name)
            continue
        if len(at):
            r0 = root(int(at[0]))
            for a in at[1:]:
                parent[root(int(a))] = r0
        applied[name] = [int(a) for a in at]
    comp = np.array([root(i) for i in range(n)], dtype=np.int64) if n else np.zeros(0, np.int64)
    return comp, applied, left


def _pack(
    names: np.ndarray, rows: np.ndarray, comp: np.ndarray, max_rows: int
) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
    """Greedy packing of the components (in the order of their first namespace) into shards
    of at most ``max_rows`` rows (a larger component gets a shard of its own), one step per
    component.

    Returns:
        ``(shards, shard_rows, ns_shard)``: the namespaces of each shard (sorted), its rows,
        and the shard of each namespace of ``names``.
    """
    n = len(names)
    first = pd.Series(np.arange(n)).groupby(comp).transform("min").to_numpy()
    by = np.lexsort((np.arange(n), first))
    comp_sorted = comp[by]
    starts = np.r_[True, comp_sorted[1:] != comp_sorted[:-1]] if n else np.zeros(0, bool)
    comp_rows = pd.Series(rows[by]).groupby(np.cumsum(starts)).transform("sum").to_numpy()
    c_idx = np.flatnonzero(starts)
    c_rows = comp_rows[c_idx]
    shard_of_comp = np.zeros(len(c_idx), np.int64)
    acc, k = 0, 0
    for j, r in enumerate(c_rows.tolist()):
        if acc and acc + r > max_rows:
            k, acc = k + 1, 0
        shard_of_comp[j] = k
        acc += r
    shard_of = shard_of_comp[np.cumsum(starts) - 1] if n else np.zeros(0, np.int64)
    n_shards = int(shard_of.max()) + 1 if n else 0
    # shard_of is non-decreasing along `by`: each shard is a run of names[by]
    shards = (
        [
            sorted(x.astype(str).tolist())
            for x in np.split(names[by], np.flatnonzero(np.diff(shard_of)) + 1)
        ]
        if n
        else []
    )
    shard_rows = np.bincount(shard_of, weights=rows[by], minlength=n_shards).astype(np.int64)
    ns_shard = np.empty(n, np.int64)
    ns_shard[by] = shard_of
    return shards, shard_rows, ns_shard


def _shards_of(batch: pa.Table) -> list[tuple[int, pa.Table]]:
    """``(shard, its stored rows)`` for each shard in a batch of either layout."""
    if "_ipc" in batch.column_names:
        return [
            (int(k), pa.ipc.open_stream(pa.py_buffer(b)).read_all())
            for k, b in zip(
                batch.column("_shard").to_pylist(), batch.column("_ipc").to_pylist(), strict=True
            )
        ]
    col = batch.column("_shard")
    return [
        (int(k), batch.filter(pc.equal(col, k)).drop_columns(["_shard"]))
        for k in pc.unique(col).to_pylist()
    ]


class _ShardPass:
    """A Ray actor that runs the pass on the shards of the blocks it is given."""

    def __init__(
        self,
        root: str,
        store_kw: dict[str, Any],
        plan: FleetPlan,
        pass_cfg: PassConfig,
        sim_cfg: SimilarityConfig,
        merge: Any,
        reflect: Any,
        wall_h: float,
        threads: int,
        book: tuple[str, str, str] | None = None,
        answers: dict[str, Any] | None = None,
    ) -> None:
        import torch
        from hydra.utils import instantiate

        from .llm.answer_book import AnswerBook

        torch.set_num_threads(max(1, threads))
        self.store = LanceStore(root, **store_kw)
        self.plan = plan
        # the store-wide safety stop is the driver's (over all shards); the per-namespace
        # one stays in each shard; an actor has its CPUs of the cluster, so its text rules
        # fork no processes unless sleep.text_workers says so
        self.cfg = replace(pass_cfg, max_drop_fraction=1.0, text_workers=pass_cfg.text_workers or 1)
        self.sim_cfg = sim_cfg
        if book is not None:  # the LLM stage answers: the merger asks the book
            self.merger = instantiate(
                merge,
                backend=AnswerBook(*book, answers or {}),
                backend_kwargs=None,
                cache_path=None,
            )
        else:
            self.merger = instantiate(merge) if merge is not None else None
        self.reflector = instantiate(reflect) if reflect is not None else None
        self.wall_h = wall_h

    def _run(self, k: int, t: pa.Table) -> dict[str, Any]:
        """Shard ``k`` (its stored rows ``t``): snapshot, pass, changes."""
        from .llm.answer_book import NeedAnswers
        from .pipeline import run_pass

        t0 = time.perf_counter()
        snap = self.store.shard_snapshot(
            t, version=self.plan.version, namespaces=self.plan.shards[k], deltas=self.plan.deltas[k]
        )
        t_load = time.perf_counter() - t0
        try:
            res = run_pass(
                snap.records,
                cfg=self.cfg,
                sim_cfg=self.sim_cfg,
                merger=self.merger,
                version=self.plan.version + 1,
                wall_h=self.wall_h,
                reflector=self.reflector,
            )
        except NeedAnswers as e:  # the LLM stage answers them; the shard runs again
            return {"asked": e.requests, "pid": os.getpid()}
        t0 = time.perf_counter()
        upsert, removed = self.store.changes(res.records, snap)
        res.stats.time_s["load"] = round(t_load, 4)
        res.stats.time_s["changes"] = round(time.perf_counter() - t0, 4)
        return {
            "upsert": upsert,
            "removed": removed,
            "events": res.events,
            "stats": res.stats.as_dict(),
            "deltas": list(snap.deltas),
            "pid": os.getpid(),
        }

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = []
        for k, t in _shards_of(batch):  # one shard per block (see plan)
            try:
                result = self._run(k, t)
            except Exception as e:  # noqa: BLE001 - the driver raises it (Ray would wrap it)
                try:
                    blob = pickle.dumps({"error": e, "pid": os.getpid()})
                    pickle.loads(blob)  # an error that pickles but does not unpickle
                except Exception:  # noqa: BLE001 - sent as its message
                    blob = pickle.dumps(
                        {"error": RuntimeError(f"{type(e).__name__}: {e}"), "pid": os.getpid()}
                    )
                out.append({"shard": int(k), "rows": t.num_rows, "result": blob})
                continue
            out.append({"shard": int(k), "rows": t.num_rows, "result": pickle.dumps(result)})
        return pa.Table.from_pylist(
            out,
            schema=pa.schema(
                [("shard", pa.int64()), ("rows", pa.int64()), ("result", pa.binary())]
            ),
        )


def _datasource(
    root: str, plan: FleetPlan, row_bytes: int, packed: bool, shard_ids: Sequence[int]
) -> Any:
    """A Ray Data datasource with one read task per shard of ``plan`` in ``shard_ids``."""
    import functools

    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class LanceShards(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return int(plan.rows[list(shard_ids)].sum()) * row_bytes

        def get_read_tasks(
            self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
        ) -> list[ReadTask]:
            return [
                ReadTask(
                    functools.partial(read_shard, root, plan.version, k, plan.shards[k], packed),
                    BlockMetadata(
                        num_rows=int(plan.rows[k]),
                        size_bytes=int(plan.rows[k]) * row_bytes,
                        input_files=None,
                        exec_stats=None,
                    ),
                )
                for k in shard_ids
            ]

    return LanceShards()


def _merge_stats(parts: list[dict[str, Any]], merger: str, version: int) -> PassStats:
    """One :class:`PassStats` for a run in shards: counts summed, ``score_min`` the lowest,
    latency percentiles the highest shard's, ``time_s`` summed (worker seconds)."""
    st = PassStats(merger=merger, version=version)
    if not parts:
        return st
    st.device = parts[0].get("device", st.device)
    st.engine = parts[0].get("engine", st.engine)
    for f in fields(PassStats):
        if f.name in _NOT_SUMMED:
            continue
        vals = [p[f.name] for p in parts if p.get(f.name) is not None]
        if not vals:
            continue
        if f.name.endswith(("_p50_s", "_p95_s")):
            setattr(st, f.name, max(vals))
        else:
            setattr(st, f.name, type(vals[0])(sum(vals)))
    mins = [p["score_min"] for p in parts if p.get("score_min") is not None]
    st.score_min = min(mins) if mins else None
    times: dict[str, float] = {}
    for p in parts:
        for k, v in p.get("time_s", {}).items():
            times[k] = times.get(k, 0.0) + v
    st.time_s = {k: round(v, 4) for k, v in times.items()}
    return st


def llm_stage(merge: Any, runner: RunnerConfig, backend: Any = None) -> dict[str, Any]:
    """The LLM stage of a fleet run (``runner.llm=ray_data``): the engine that answers the
    merge requests of every shard, the key its answers are filed under, the response cache.

    Args:
        merge: the merger's Hydra config (``_target_`` dict): an
            :class:`~consolidate.llm.merger.LLMMerger` with ``backend: vllm`` (its
            ``backend_kwargs`` set the engine, e.g. ``merge=vllm``).
        runner: ``llm_concurrency``, ``llm_batch_size``, ``llm_gpus_per_engine``.
        backend: an engine to use instead of building
            :class:`~consolidate.llm.ray_data_backend.RayDataVLLM` (any backend object with
            ``name``, ``model`` and ``chat``).

    Returns:
        ``{"engine": backend, "book": (name, model, prompt version), "cache": ResponseCache
        or None}``.

    Raises:
        ValueError: the merger is not an LLM merger on the ``vllm`` backend.
    """
    from .llm.cache import ResponseCache
    from .llm.merger import merge_prompt_version

    if merge is not None and not isinstance(merge, Mapping):
        raise ValueError(
            f"runner.llm=ray_data needs the merger's config (a mapping with "
            f"_target_, e.g. from merge=vllm), got {type(merge).__name__}"
        )
    merge = dict(merge or {})
    if not str(merge.get("_target_", "")).endswith("LLMMerger"):
        raise ValueError(
            f"runner.llm=ray_data sends merge prompts to vLLM: it needs an LLM "
            f"merger (merge=vllm), not {merge.get('_target_')!r}"
        )
    if backend is None:
        if merge.get("backend") != "vllm":
            raise ValueError(
                f"runner.llm=ray_data runs vLLM: it needs merge=vllm (the "
                f"merger's backend is {merge.get('backend')!r})"
            )
        from .llm.ray_data_backend import RayDataVLLM

        backend = RayDataVLLM(
            **dict(merge.get("backend_kwargs") or {}),
            concurrency=runner.llm_concurrency,
            batch_size=runner.llm_batch_size,
            gpus_per_engine=runner.llm_gpus_per_engine,
        )
    version = merge_prompt_version(bool(merge.get("handles_conflicts", False)))
    path = merge.get("cache_path")
    cache = ResponseCache(path, backend.name, backend.model, version) if path else None
    return {
        "engine": backend,
        "book": (backend.name, backend.model, version),
        "cache": cache,
        "requests": 0,
        "cached": 0,
        "seconds": 0.0,
    }


def _answer(llm: dict[str, Any], asked: Sequence[Any]) -> dict[str, Any]:
    """Answers (key -> ChatResponse) to the requests the shards asked for: from the response
    cache where it has them, the rest from the LLM stage's engine in one call (then
    cached). Requests asked by several shards are sent once."""
    from .llm.cache import request_key

    name, model, version = llm["book"]
    unique: dict[str, Any] = {}
    for r in asked:
        unique.setdefault(request_key(name, model, version, r), r)
    found = llm["cache"].get(unique) if llm["cache"] is not None else {}
    todo = [k for k in unique if k not in found]
    t = time.perf_counter()
    fresh = llm["engine"].chat([unique[k] for k in todo]) if todo else []
    if len(fresh) != len(todo):
        raise RuntimeError(f"the LLM stage returned {len(fresh)} answers for {len(todo)} requests")
    llm["seconds"] += time.perf_counter() - t
    pairs = list(zip(todo, fresh, strict=True))
    if llm["cache"] is not None:
        llm["cache"].put(pairs)
    llm["requests"] += len(unique)
    llm["cached"] += len(found)
    return {**found, **dict(pairs)}


def run_fleet_pass(
    store: LanceStore,
    *,
    namespaces: Sequence[str] | None,
    pass_cfg: PassConfig,
    sim_cfg: SimilarityConfig,
    runner: RunnerConfig,
    merge: Any = None,
    reflect: Any = None,
    wall_h: float | None = None,
    dry_run: bool = False,
    llm_backend: Any = None,
) -> dict[str, Any]:
    """Run the pass over ``namespaces`` of ``store`` on Ray Data and commit its changes.

    Must be called while holding ``store.lock()``. Starts a local Ray cluster when none is
    running and ``runner.address`` is ``None`` (and shuts it down after), joins
    ``runner.address`` otherwise.

    Args:
        store: a Lance store.
        namespaces: the namespaces to run (``None``: all).
        pass_cfg, sim_cfg: as for :func:`~consolidate.pipeline.run_pass`.
        runner: actors, CPUs/GPUs per actor, rows per shard, cluster address.
        merge, reflect: Hydra configs (``_target_`` dicts) of the merger and the
            reflector; each actor builds its own (``None``: extractive merger, no
            reflector).
        wall_h: the pass's wall time (hours since the epoch; default now), the same for
            every shard.
        dry_run: write only the changelog.
        llm_backend: with ``runner.llm=ray_data``, an engine object to answer the merges
            instead of Ray Data's vLLM processor (see :func:`llm_stage`).

    With ``runner.llm=ray_data`` the actors' merger sends nothing itself: the shards run in
    rounds; a round stops each shard at its first model call and hands its requests to the
    driver, which has the LLM stage (:func:`llm_stage`) answer the requests of all shards
    at once, and the next round runs those shards again with the answers (an LLM merger
    needs three rounds: first answers, retries, done). The records are those the same
    merger gives in one process with the same answers; answers go to the merger's
    response cache, so a rerun repeats no model call. A reflector, if any, still calls its
    own backend from each actor.

    Returns:
        ``{"commit": ..., "stats": PassStats, "fleet": {...}, "base_version": N,
        "records_read": rows}``; ``fleet`` holds the shard count, the actors used (distinct
        worker processes), the Ray wall time and the planning time, and with an LLM stage
        ``llm`` (rounds, distinct requests, those found in the cache, the engine's
        seconds); with ``runner.shards_per_commit``, ``commits`` (the versions written, in
        order; ``commit`` is the last).

    Raises:
        MassDropError: the drops of all shards together (of one group, with
            ``runner.shards_per_commit``) exceed ``pass_cfg.max_drop_fraction`` of their
            live rows, or a namespace's floor drops exceed ``max_namespace_drop_fraction``
            (nothing is committed; with groups, the groups committed before stay).
        Exception: a shard's own error, as it raised it (with groups, after the other
            shards done are committed).
        ValueError: bad runner settings, or ``runner.llm=ray_data`` without an LLM merger.
        ImportError: Ray Data is not installed.
    """
    ray = _ray_for(store, runner)
    run = _FleetRun(
        store,
        namespaces=namespaces,
        pass_cfg=pass_cfg,
        runner=runner,
        wall_h=time.time() / 3600 if wall_h is None else float(wall_h),
        dry_run=dry_run,
    )
    llm = llm_stage(merge, runner, llm_backend) if runner.llm == "ray_data" else None
    checker, run.check = store.verify_in_thread(run.version)
    run.checker = checker
    actor_kw = run.actor_kwargs(sim_cfg, merge, reflect)
    t0 = time.perf_counter()
    run.run_shards(ray, llm, runner, actor_kw)
    return run.finish(llm, time.perf_counter() - t0)


def _ray_for(store: LanceStore, runner: RunnerConfig) -> Any:
    """The ``ray`` module, once the store and the runner settings allow a fleet run.

    Raises:
        TypeError: not a Lance store. ImportError: Ray Data is not installed.
        ValueError: bad runner settings, or a vector dtype conversion pending.
    """
    if not store.PARTIAL_LOADS:
        raise TypeError(
            f"a fleet run needs a Lance store; {store.root} is a {store.FORMAT.capitalize()} store "
            f"(consolidate-convert makes a Lance copy)"
        )
    try:
        import ray
    except ImportError as e:
        raise ImportError('runner=ray needs Ray Data: pip install "ray[data]"') from e
    _check_runner(runner)
    if store.vector_dtype and store.vector_dtype != store._vector_dtype(store._open().schema):
        raise ValueError(
            "a vector dtype conversion rewrites the whole store: run it with runner=local"
        )
    return ray


def _check_runner(runner: RunnerConfig) -> None:
    """The runner's settings, checked before the store is read.

    Raises:
        ValueError: a count that is not a positive integer, a negative or infinite CPU or
            GPU reservation, an unknown ``runner.llm``.
    """

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if not count(runner.actors):
        raise ValueError(f"runner.actors must be an integer >= 1, got {runner.actors!r}")
    if not count(runner.max_rows_per_shard):
        raise ValueError(
            f"runner.max_rows_per_shard must be an integer >= 1, got {runner.max_rows_per_shard!r}"
        )
    if not (
        isinstance(runner.cpus_per_actor, (int, float))
        and not isinstance(runner.cpus_per_actor, bool)
        and 0 <= runner.cpus_per_actor < math.inf
    ):
        raise ValueError(
            f"runner.cpus_per_actor must be a number >= 0, got {runner.cpus_per_actor!r}"
        )
    g = runner.gpus_per_actor
    if not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0 <= g < math.inf):
        raise ValueError(f"runner.gpus_per_actor must be a number >= 0, got {g!r}")
    spc = runner.shards_per_commit
    if not (count(spc) or (isinstance(spc, int) and not isinstance(spc, bool) and spc == 0)):
        raise ValueError(f"runner.shards_per_commit must be an integer >= 0, got {spc!r}")
    if runner.llm not in ("actor", "ray_data"):
        raise ValueError(f"runner.llm must be actor or ray_data, got {runner.llm!r}")


def _start_ray(ray: Any, runner: RunnerConfig) -> bool:
    """Join or start the Ray cluster (``True``: this run started it, and shuts it down),
    check it has the CPUs and GPUs one actor reserves, and set Ray Data's context (a shard
    is one block, no progress bars).

    Raises:
        ValueError: an actor's reservation exceeds the cluster (Ray would wait for it
            forever, with the store locked).
    """
    started = False
    if not ray.is_initialized():
        ray.init(
            address=runner.address,
            num_cpus=runner.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        started = True
    res = ray.cluster_resources()
    for key, want in (("CPU", runner.cpus_per_actor), ("GPU", runner.gpus_per_actor)):
        have = float(res.get(key, 0.0))
        if want > have:
            raise ValueError(
                f"runner.{key.lower()}s_per_actor={want} exceeds the cluster's {have:g} {key}s"
            )
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.target_max_block_size = None  # a shard is one block: never split
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return started


class _FleetRun:
    """One :func:`run_fleet_pass`: its shard plan (made at construction), the shards done,
    those not committed yet, and the commits written."""

    def __init__(
        self,
        store: LanceStore,
        *,
        namespaces: Sequence[str] | None,
        pass_cfg: PassConfig,
        runner: RunnerConfig,
        wall_h: float,
        dry_run: bool,
    ) -> None:
        self.store, self.namespaces, self.pass_cfg, self.runner = (
            store,
            namespaces,
            pass_cfg,
            runner,
        )
        self.wall_h, self.dry_run = wall_h, dry_run
        # GPU actors need a fixed batch size: each shard then travels as one row (packed)
        self.packed = runner.gpus_per_actor > 0
        t0 = time.perf_counter()
        self.version, pending = store.pending()
        self.plan = plan_shards(
            store,
            version=self.version,
            pending=pending,
            namespaces=namespaces,
            max_rows=runner.max_rows_per_shard,
        )
        self.fleet: dict[str, Any] = {
            "shards": len(self.plan.shards),
            "rows": int(self.plan.rows.sum()),
            "plan_s": round(time.perf_counter() - t0, 4),
            "deltas_left_pending": len(self.plan.left_pending),
        }
        self.per = 0 if dry_run else runner.shards_per_commit
        self.done: dict[int, dict[str, Any]] = {}  # shard -> its result
        self.ready: list[int] = []  # done shards not committed yet
        self.commits: list[dict[str, Any]] = []
        self.commit_s = 0.0
        self.checker: Any = None
        self.check: dict[str, Any] = {}
        self.dim = 0  # the vectors' width, read when the rounds start

    @staticmethod
    def merger_name(parts: list[dict[str, Any]]) -> str:
        return parts[0]["stats"]["merger"] if parts else ""

    def none_committed(self) -> dict[str, Any]:
        return {
            "version": self.store.head().version if self.commits else self.version,
            "snapshot": None,
            "changelog": None,
            "carried_records": 0,
            "carried_touches": 0,
            "rows_written": 0,
        }

    def commit_group(self, group: list[int], whole_run: bool = False) -> dict[str, Any]:
        """Commit the shards ``group`` (all of them with ``whole_run``) after the
        store-wide safety stop over their drops; drop them from ``ready``."""
        store, version, pass_cfg = self.store, self.version, self.pass_cfg
        parts = [self.done[k] for k in group]
        if not parts:
            return self.none_committed()
        self.checker.join()  # never commit what a damaged snapshot gave
        if "error" in self.check:
            raise self.check["error"]
        st = _merge_stats([p["stats"] for p in parts], self.merger_name(parts), version + 1)
        live = st.records_out + st.dropped_floor + st.dropped_cap
        dropped = st.dropped_floor + st.dropped_cap
        events = [e for p in parts for e in p["events"]]
        if live and dropped / live > pass_cfg.max_drop_fraction:
            raise mass_drop_error(
                dropped, live, [e["namespace"] for e in events if e.get("op") == "drop"], pass_cfg
            )
        t = time.perf_counter()
        if self.dry_run:
            log_name = store._changelog(events, version + 1, dry_run=True)
            info = {
                "version": version,
                "snapshot": None,
                "changelog": log_name,
                "carried_records": 0,
                "carried_touches": 0,
            }
        else:
            tables = [p["upsert"] for p in parts if p["upsert"].num_rows]
            scope = (
                (None if self.namespaces is None else list(self.namespaces))
                if whole_run
                else sorted({ns for k in group for ns in self.plan.shards[k]})
            )
            info = store.commit_changes(
                pa.concat_tables(tables) if tables else parts[0]["upsert"],
                [i for p in parts for i in p["removed"]],
                events,
                # a group's commit follows this run's previous one (other namespaces)
                base_version=self.commits[-1]["version"] if self.commits else version,
                folded=[d for p in parts for d in p["deltas"]],
                namespaces=scope,
                pass_time_h=self.wall_h,
            )
            self.commits.append(info)
        self.commit_s += time.perf_counter() - t
        self.ready[:] = [k for k in self.ready if k not in set(group)]
        return info

    def stream_shards(
        self,
        ray: Any,
        actor_kw: dict[str, Any],
        llm: Any,
        shard_ids: list[int],
        answers: dict[str, Any] | None,
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(shard, result)`` of each shard as its actor returns it.

        Raises:
            RuntimeError: a shard came back split, twice, or never.
        """
        plan, runner = self.plan, self.runner
        # a read is a Lance scan on Lance's own threads: it reserves no CPU, so
        # actors that take every CPU of the cluster cannot starve it
        ds = ray.data.read_datasource(
            _datasource(str(self.store.root), plan, self.dim * 4 + 256, self.packed, shard_ids),
            num_cpus=0,
            # reads reserve no CPU, so bound them: as many at a time as actors
            # (Ray would otherwise start a worker process per pending read)
            concurrency=max(1, min(runner.actors, len(shard_ids))),
            # one block per read task: no split to reach Ray's minimum block count
            override_num_blocks=len(shard_ids),
        )
        kw = dict(actor_kw)
        if llm is not None:
            kw.update(book=llm["book"], answers=answers)
        out = ds.map_batches(
            _ShardPass,
            batch_size=1 if self.packed else None,
            batch_format="pyarrow",
            fn_constructor_kwargs=kw,
            compute=ray.data.ActorPoolStrategy(size=min(runner.actors, len(shard_ids))),
            num_cpus=runner.cpus_per_actor,
            num_gpus=runner.gpus_per_actor or None,
        )
        seen: set[int] = set()
        for b in out.iter_batches(batch_size=None, batch_format="pyarrow"):
            for k, r, blob in zip(
                b.column("shard").to_pylist(),
                b.column("rows").to_pylist(),
                b.column("result").to_pylist(),
                strict=True,
            ):
                if k in seen or r != int(plan.rows[k]):
                    raise RuntimeError(
                        f"fleet run: shard {k} came back split or "
                        f"twice ({r} of {int(plan.rows[k])} rows)"
                    )
                seen.add(k)
                yield k, pickle.loads(blob)
        if seen != set(shard_ids):
            missing = sorted(set(shard_ids) - seen)
            raise RuntimeError(f"fleet run: shards {missing[:10]} never came back")

    def rounds(self, ray: Any, llm: Any, actor_kw: dict[str, Any]) -> None:
        """Run the shards, in rounds while they ask for model answers (the LLM stage answers
        each round's requests of all shards at once); with ``runner.shards_per_commit``,
        commit each group as it is done, and the shards done before a failure.

        Raises:
            Exception: the first shard's error, as its actor raised it.
            RuntimeError: shards still ask for answers after the last round (or with no
                LLM stage).
        """
        per, ready = self.per, self.ready
        self.dim = int(self.store._marker()["dim"])  # a row's bytes, for the reads
        todo = list(range(len(self.plan.shards)))
        answers: dict[str, Any] = {}
        for rnd in range(_MAX_ROUNDS):
            asked: dict[int, list[Any]] = {}
            failed = None
            for k, p in self.stream_shards(ray, actor_kw, llm, todo, answers):
                if "error" in p:
                    failed = failed or p
                elif "asked" in p:
                    asked[k] = p["asked"]
                else:
                    self.done[k] = p
                    ready.append(k)
                    if per and len(ready) >= per and not failed:
                        self.commit_group(ready[:per])
            if failed:  # the first shard's error, as the actor raised it; with
                # commits per group, the shards done so far are committed first
                if per:
                    self.commit_group(list(ready))
                raise failed["error"]
            todo = sorted(asked)
            if not todo:
                break
            if rnd == _MAX_ROUNDS - 1 or llm is None:
                raise RuntimeError(
                    f"fleet run: shards {todo[:10]} still ask for model "
                    f"answers after {_MAX_ROUNDS} rounds"
                )
            try:
                answers.update(_answer(llm, [r for k in todo for r in asked[k]]))
            except BaseException:  # the stage failed: keep the shards done so far
                if per:
                    self.commit_group(list(ready))
                raise
            self.fleet["llm_rounds"] = self.fleet.get("llm_rounds", 0) + 1
        if per:
            self.commit_group(list(ready))

    def actor_kwargs(self, sim_cfg: SimilarityConfig, merge: Any, reflect: Any) -> dict[str, Any]:
        """The keyword arguments each shard actor is built with: the store's folder and
        settings, the plan, the pass's configs and wall time, its torch threads."""
        store = self.store
        return {
            "root": str(store.root),
            "store_kw": {
                "quarantine": store.quarantine,
                "future_tolerance_h": store.future_tolerance_h,
            },
            "plan": self.plan,
            "pass_cfg": self.pass_cfg,
            "sim_cfg": sim_cfg,
            "merge": merge,
            "reflect": reflect,
            "wall_h": self.wall_h,
            "threads": max(1, math.floor(self.runner.cpus_per_actor)),
        }

    def run_shards(
        self, ray: Any, llm: Any, runner: RunnerConfig, actor_kw: dict[str, Any]
    ) -> None:
        """Run the plan's shards on Ray (a local cluster started for the run when none is
        running and ``runner.address`` is ``None``, shut down after), round after round
        (:meth:`rounds`); waits for the store check. A failure after some versions were
        committed is logged with them, then raised."""
        started = False
        try:
            if self.plan.shards:
                started = _start_ray(ray, runner)
                self.rounds(ray, llm, actor_kw)
        except BaseException:
            if self.commits:
                log.warning(
                    "fleet run failed after committing versions %s (%d of %d shards); "
                    "a rerun passes over their namespaces again",
                    [c["version"] for c in self.commits],
                    len(self.done) - len(self.ready),
                    len(self.plan.shards),
                )
            raise
        finally:
            self.checker.join()
            if started:
                with contextlib.suppress(Exception):
                    ray.shutdown()

    def finish(self, llm: Any, ray_s: float) -> dict[str, Any]:
        """The run's commit (the whole run's, unless committed per group) and its summary
        fields (see :func:`run_fleet_pass`)."""
        if "error" in self.check:
            raise self.check["error"]
        fleet = self.fleet
        fleet["ray_s"] = round(ray_s, 4)
        if llm is not None:
            fleet["llm"] = {
                "rounds": fleet.pop("llm_rounds", 0),
                "requests": llm["requests"],
                "cached": llm["cached"],
                "seconds": round(llm["seconds"], 4),
            }
        parts = [self.done[k] for k in sorted(self.done)]
        fleet["workers"] = len({p["pid"] for p in parts})
        stats = _merge_stats([p["stats"] for p in parts], self.merger_name(parts), self.version + 1)
        if self.per:
            fleet["commits"] = [c["version"] for c in self.commits]
            commit = self.commits[-1] if self.commits else self.none_committed()
        else:
            commit = self.commit_group(sorted(self.done), whole_run=True)
        stats.time_s["commit"] = round(self.commit_s, 4)
        return {
            "commit": commit,
            "stats": stats,
            "fleet": fleet,
            "base_version": self.version,
            "records_read": int(self.plan.rows.sum()),
        }
