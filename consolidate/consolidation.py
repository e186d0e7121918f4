"""The nightly run over one store or an external source, as ``consolidate`` runs it: open
or build the store, check the trigger, run the pass (in this process or on Ray Data),
commit, and summarise (``run_consolidate``; the printed table is
:func:`consolidate.summary.format_summary`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from .evaluation.thresholds import load_calibration
from .factory import (
    expect_plan_text,
    make_embedder,
    open_store,
    pass_cfg,
    sim_cfg,
    typed,
    write_summary,
)
from .pipeline import check_settings, run_pass, trigger
from .similarity import check_engine
from .sources.base import Source
from .store import hours_now
from .store.base import MemoryStore
from .store.lance import LanceStore

log = logging.getLogger("consolidate")


def _settings_file(load: Any, key: str, path: str) -> Any:
    """``load(path)`` with a missing or unreadable file named by its config key."""
    try:
        return load(path)
    except FileNotFoundError:
        raise ValueError(f"{key}={path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{key}={path} is a folder, not a file") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={path}: {e}") from None


def run_consolidate(cfg: DictConfig, out_dir: str | None = None) -> dict[str, Any]:
    """Open (or build) the store, check the trigger, run the pass, commit, write a summary.

    Three paths after the settings are checked: an external source (``source=...``, in this
    process), a fleet run on Ray (``runner=ray``, a Lance store) or the pass in this process
    on the store (:func:`_local_run`).

    Args:
        cfg: composed ``consolidate`` config.
        out_dir: where ``summary.json`` goes (default: Hydra's output dir or ``outputs/``).

    Returns:
        The run summary (also written to ``<out_dir>/summary.json``).
    """
    from .config import StoreConfig

    t0 = time.perf_counter()
    pc, sc, rc, src, calibration, policy = _settings(cfg)
    fleet = rc.kind == "ray"
    calibrated = {**policy, "calibrated": True} if policy is not None else {"calibrated": False}
    if src.kind != "store":
        if fleet:
            raise ValueError(f"source={src.kind} runs in this process: use runner=local")
        # the source is opened and read (and its errors raised) before any model loads
        summary = _external_run(
            cfg,
            src,
            pc,
            sc,
            lambda: instantiate(cfg.merge),
            lambda: instantiate(cfg.reflect) if pc.reflect else None,
            out_dir,
        )
        summary["policy"] = calibrated
        return _finish(summary, t0, out_dir)
    # a fleet run's actors build their own merger and reflector (from these configs)
    merger = None if fleet else instantiate(cfg.merge)
    reflector = instantiate(cfg.reflect) if pc.reflect and not fleet else None
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    t = time.perf_counter()
    store, report = open_store(cfg)
    summary = _store_summary(cfg, store, report, time.perf_counter() - t, calibration, calibrated)
    if fleet and not store.PARTIAL_LOADS:
        raise ValueError(
            f"runner=ray needs a Lance store; {store.root} is a {store.FORMAT.capitalize()} store "
            f"(consolidate-convert src=... dst=... makes a Lance copy)"
        )
    with store.lock(timeout_s=scfg.lock_timeout_s):
        if fleet:
            summary.update(_fleet_run(cfg, store, pc, sc, rc))
            return _finish(summary, t0, out_dir)
        summary.update(_local_run(store, pc, sc, merger, reflector))
    summary["refused_deltas"] = list(store.refused_deltas)
    return _finish(summary, t0, out_dir)


def _settings(cfg: DictConfig) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The pass, similarity, runner and source settings, with a calibration file's threshold
    and a policy file's settings applied, all checked before any store is built or model
    loaded. Returns ``(pass, similarity, runner, source, calibration, policy)``."""
    from .config import RunnerConfig, SourceConfig

    pc = pass_cfg(cfg)
    calibration = None
    if pc.calibration_file:
        calibration = _settings_file(
            load_calibration, "sleep.calibration_file", pc.calibration_file
        )
        pc.threshold = calibration["threshold"]
    policy = None
    if pc.policy_file:
        from .evaluation.policy import load_policy

        policy = _settings_file(load_policy, "sleep.policy_file", pc.policy_file)
        for k, v in policy["pass"].items():
            setattr(pc, k, v)
    check_settings(pc)  # bad values fail now, not on the night the trigger fires
    sc = sim_cfg(cfg)
    check_engine(sc.engine, sc.device)  # settings errors before any store is built
    rc: RunnerConfig = typed(cfg, "runner", RunnerConfig) if "runner" in cfg else RunnerConfig()
    if rc.kind not in ("local", "ray"):
        raise ValueError(f"runner.kind must be 'local' or 'ray', got {rc.kind!r}")
    src: SourceConfig = typed(cfg, "source", SourceConfig) if "source" in cfg else SourceConfig()
    src.expect_plan = expect_plan_text(src.expect_plan)
    return pc, sc, rc, src, calibration, policy


def _store_summary(
    cfg: DictConfig,
    store: MemoryStore,
    report: dict[str, Any] | None,
    t_build: float,
    calibration: dict[str, Any] | None,
    policy: dict[str, Any],
) -> dict[str, Any]:
    """The summary's head: the store, the resolved config, the calibration used, the
    retention policy (calibrated from a policy.json, with its measured cost, or not) and,
    when this run built the store, the import's counts."""
    summary: dict[str, Any] = {
        "store": str(store.root),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if calibration is not None:
        summary["calibration"] = calibration
    summary["policy"] = policy
    if report is not None:
        summary["import"] = {k: report[k] for k in ("observations", "conversations", "sha256")}
        for k in ("malformed_evidence", "malformed_items", "bad_times"):
            summary["import"][k] = len(report[k])
        summary["import"]["time_s"] = round(t_build, 3)
    return summary


def _local_run(store: MemoryStore, pc: Any, sc: Any, merger: Any, reflector: Any) -> dict[str, Any]:
    """The pass in this process, under the caller's store lock: the trigger (per namespace
    on a store with partial loads and ``sleep.incremental``, else store-wide), then, when it
    fires or ``sleep.force``, the pass, the commit and the store's housekeeping. Returns the
    summary's fields (``trigger``, ``base_version``, ``records_read``, ``ran``, and for a
    pass that ran ``dry_run``, ``commit``, ``stats``)."""
    out: dict[str, Any] = {}
    t = time.perf_counter()
    if store.PARTIAL_LOADS and pc.incremental and not pc.force:
        # per namespace: read only the namespaces whose new memories fired
        fired, per_ns = store.trigger(pc.trigger_importance)  # type: ignore[attr-defined]
        new_imp, fire = float(sum(per_ns.values())), bool(fired)
        snap = store.load(namespaces=fired)  # type: ignore[call-arg]
        scope = {"namespaces_fired": len(fired), "namespaces_with_new": len(per_ns)}
    else:
        snap = store.load()
        fire, new_imp = trigger(snap.records, pc.trigger_importance)
        scope = {}
    t_load = time.perf_counter() - t
    out["trigger"] = _trigger_summary(pc, new_imp, fire, scope)
    out["base_version"] = snap.version
    out["records_read"] = len(snap.records)
    if not (fire or pc.force):
        out["ran"] = False
        return out
    wall = hours_now()
    res = run_pass(
        snap.records,
        cfg=pc,
        sim_cfg=sc,
        merger=merger,
        version=snap.version + 1,
        wall_h=wall,
        reflector=reflector,
    )
    t = time.perf_counter()
    commit = store.commit(res.records, res.events, base=snap, dry_run=pc.dry_run, pass_time_h=wall)
    res.stats.time_s["load"] = round(t_load, 4)
    res.stats.time_s["commit"] = round(time.perf_counter() - t, 4)
    if not pc.dry_run and not commit.get("unchanged"):
        _cleanup(store, commit, res.stats.time_s)
    out.update(ran=True, dry_run=pc.dry_run, commit=commit, stats=res.stats.as_dict())
    return out


def _external_run(
    cfg: DictConfig,
    src: Any,
    pc: Any,
    sc: Any,
    make_merger: Any,
    make_reflector: Any,
    out_dir: str | None,
) -> dict[str, Any]:
    """The pass over an external store (``source=pgvector``: :mod:`consolidate.sources.
    pgvector`; ``source=mem0``: :mod:`consolidate.sources.mem0`; ``source=jsonl``:
    :class:`consolidate.sources.files.FileSource`; ``source=lance``:
    :mod:`consolidate.sources.lance_table`): read a snapshot, run the pass with
    nothing held open, plan, apply (a dry run unless ``source.apply``). The
    pass's events go to ``events.jsonl`` beside the summary (they keep the members of every
    merge); an apply records its units in the source's undo journal (``consolidate-undo``).
    Returns the summary's fields."""
    from .config import EmbedderConfig
    from .sources.open import open_source

    source, name = open_source(src, lambda: make_embedder(typed(cfg, "embedder", EmbedderConfig)))
    t = time.perf_counter()
    snap, records, no_vector = _read_source(source, name, src)
    t_load = time.perf_counter() - t
    fire, new_imp = trigger(records, pc.trigger_importance)
    summary: dict[str, Any] = {
        "store": name,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "trigger": _trigger_summary(pc, new_imp, fire, {}),
        "records_read": len(records),
        "records_without_vector": no_vector,
    }
    if not (fire or pc.force) or not len(records):
        summary["ran"] = False
        return summary
    wall = hours_now()
    res = run_pass(
        records,
        cfg=pc,
        sim_cfg=sc,
        merger=make_merger(),
        version=content_version(records),
        wall_h=wall,
        reflector=make_reflector(),
    )
    if out_dir is None:
        out_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs"
    t = time.perf_counter()
    plan, rep = _plan_and_apply(
        source, snap, res.records, pc.dry_run or not src.apply, out_dir, src.expect_plan
    )
    res.stats.time_s["load"] = round(t_load, 4)
    res.stats.time_s["commit"] = round(time.perf_counter() - t, 4)
    events = _write_plan_files(out_dir, res.events, plan, rep)
    summary.update(
        ran=True,
        dry_run=rep.dry_run,
        stats=res.stats.as_dict(),
        external={
            "plan_id": plan.plan_id,
            "units": plan.counts(),
            "applied": rep.applied,
            "skipped": rep.skipped[:100],
            "n_skipped": len(rep.skipped),
            "events": str(events),
            "undo": getattr(rep, "undo_file", None),
            "written": getattr(rep, "written", None),
            "version": getattr(rep, "version", None),
            "previous_version": getattr(rep, "previous", None),
            "backup": getattr(rep, "backup", None),
            "late": rep.late,
            "carried": getattr(rep, "carried", 0),
        },
    )
    return summary


def _read_source(source: Any, name: str, src: Any) -> tuple[Any, Any, int]:
    """The source's snapshot, its records for the pass and how many live rows have no vector
    yet (logged, left out).

    Raises:
        ValueError: the source reads as empty, unless ``source.allow_empty``.
    """
    snap = source.read(src.namespaces)
    records = source.records(snap)
    no_vector = getattr(snap, "no_vector", 0)
    if no_vector:
        log.warning(
            "%s: %d live rows have no vector yet (left out of the pass, untouched), e.g. %s",
            name,
            no_vector,
            snap.no_vector_ids[:5],
        )
    if not len(records) and not no_vector and not src.allow_empty:
        where = f" in namespaces {list(src.namespaces)}" if src.namespaces is not None else ""
        raise ValueError(
            f"{name} holds no memories{where}: check the source's settings (a mistyped path, "
            f"table or namespace reads as empty); source.allow_empty=true runs on an empty "
            f"source"
        )
    return snap, records, no_vector


def _plan_and_apply(
    source: Source,
    snap: Any,
    records: Any,
    dry: bool,
    out_dir: str,
    expect: str | None = None,
) -> tuple[Any, Any]:
    """The source's plan for the pass's ``records`` and its apply (``dry``: a dry run; a
    memory file's dry run writes ``consolidated.<suffix>`` into ``out_dir``). ``expect``:
    the plan id prefix that :func:`~consolidate.factory.expect_plan_text` checked (a dry
    run only logs whether the plan matches it).

    Raises:
        ValueError: an apply whose plan is not ``expect`` (the dry run's plan id): the
            source changed since; nothing written (the plan goes to ``out_dir``).
    """
    plan = source.plan(snap, records)
    if expect is not None and dry:
        same = "matches it" if plan.plan_id.startswith(expect) else "differs"
        log.warning(
            "source.expect_plan=%s binds an apply only (source.apply=true); the plan made now "
            "is %s (%s)",
            expect,
            plan.plan_id[:12],
            same,
        )
    elif expect is not None and not plan.plan_id.startswith(expect):
        from .sources.common import ApplyReport

        _write_plan_files(out_dir, [], plan, ApplyReport(dry_run=True))
        units = ", ".join(f"{n} {k}" for k, n in sorted(plan.counts().items()))
        raise ValueError(
            f"source.expect_plan={expect}: the plan made now is {plan.plan_id[:12]} "
            f"({units or 'no units'}; {out_dir}/plan.json): the source changed since the "
            f"dry run, nothing written; review that plan, then apply it with "
            f"source.expect_plan={plan.plan_id[:12]}"
        )
    return plan, source.apply(plan, dry_run=dry, out_dir=out_dir)


def _write_plan_files(out_dir: str, events: list[dict[str, Any]], plan: Any, rep: Any) -> Any:
    """``events.jsonl`` (every event of the pass) and ``plan.json`` (the units, ISO times,
    what was skipped) in ``out_dir``; returns the events file's path."""
    import json
    from pathlib import Path

    path = Path(out_dir) / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e, default=str) + "\n" for e in events))
    (Path(out_dir) / "plan.json").write_text(
        json.dumps(
            {
                "plan_id": plan.plan_id,
                "dry_run": rep.dry_run,
                "units": iso_times(plan.units),
                "skipped": rep.skipped,
                "late": rep.late,
            },
            indent=1,
            default=str,
        )
    )
    return path


#: plan-unit keys whose values are times (hours since the epoch)
_TIME_KEYS = frozenset(("created_at", "last_used", "deleted_at", "valid_from", "valid_to"))


def iso_times(x: Any) -> Any:
    """``x`` (a plan's units: dicts and lists) with every time (a ``_TIME_KEYS`` value in
    hours since the epoch) as ISO 8601 UTC text; NaN and ``None`` as
    ``None``. For ``plan.json``, which people and pandas read."""
    from .store.schema import datetime_from_hours

    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if k in _TIME_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = None if v != v else datetime_from_hours(float(v)).isoformat()
            else:
                out[k] = iso_times(v)
        return out
    if isinstance(x, list):
        return [iso_times(v) for v in x]
    return x


def content_version(records: Any) -> int:
    """A pass version for records read from an external source: a hash of which memories
    were read (ids, texts, importance, strength, pinned; not times, which a source without
    them fills with the time of the read), in ``[1, 2**31)``. Merged ids mix in the version,
    so a dry run and the apply that follows on the same memories plan the same merged ids,
    and other memories plan others."""
    import pandas as pd

    cols = ["id", "text", "importance", "strength", "pinned"]
    h = pd.util.hash_pandas_object(records.meta[cols], index=False).to_numpy()
    mixed = int((h * np.uint64(0x9E3779B97F4A7C15)).sum(dtype=np.uint64) ^ np.uint64(len(h)))
    return 1 + mixed % (2**31 - 1)


def _trigger_summary(pc: Any, new_imp: float, fire: bool, scope: dict[str, Any]) -> dict[str, Any]:
    """The summary's ``trigger`` block (and a log line when it did not fire)."""
    if not (fire or pc.force):
        log.info(
            "trigger did not fire: new importance %.3f < %.3f (use sleep.force=true)",
            new_imp,
            pc.trigger_importance,
        )
    return {
        "new_importance": round(new_imp, 4),
        "threshold": pc.trigger_importance,
        "fired": fire,
        "forced": pc.force,
        **scope,
    }


def _cleanup(store: MemoryStore, commit: dict[str, Any], times: dict[str, float]) -> None:
    """The store's housekeeping after a commit (:meth:`MemoryStore.maintain`: a Lance store
    compacts and removes old versions), timed; nothing where the store has none."""
    t = time.perf_counter()
    done = store.maintain()
    if done is not None:
        commit["cleanup"] = done
        times["cleanup"] = round(time.perf_counter() - t, 4)


def _finish(summary: dict[str, Any], t0: float, out_dir: str | None) -> dict[str, Any]:
    """Stamp the wall time and write ``summary.json``."""
    summary["wall_time_s"] = round(time.perf_counter() - t0, 3)
    if out_dir is None:
        out_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs"
    summary["summary_path"] = str(write_summary(out_dir, summary))
    return summary


def _fleet_run(cfg: DictConfig, store: LanceStore, pc: Any, sc: Any, rc: Any) -> dict[str, Any]:
    """The pass on Ray Data (:func:`consolidate.fleet.run_fleet_pass`), under the store's
    lock: the trigger per namespace (``sleep.incremental``) or over the store, then the
    shards, then one commit and the cleanup. Returns the summary's fields."""
    from .fleet import run_fleet_pass

    out: dict[str, Any] = {}
    t = time.perf_counter()
    fired, per_ns = store.trigger(pc.trigger_importance)
    new_imp = float(sum(per_ns.values()))
    if pc.incremental and not pc.force:
        namespaces: list[str] | None = fired
        fire = bool(fired)
        scope = {"namespaces_fired": len(fired), "namespaces_with_new": len(per_ns)}
    else:
        namespaces, fire, scope = None, new_imp >= pc.trigger_importance, {}
    out["trigger"] = _trigger_summary(pc, new_imp, fire, scope)
    if not (fire or pc.force):
        out.update(ran=False, base_version=store.head().version, records_read=0)
        return out
    t_trigger = time.perf_counter() - t
    merge = OmegaConf.to_container(cfg.merge, resolve=True)
    reflect = OmegaConf.to_container(cfg.reflect, resolve=True) if pc.reflect else None
    res = run_fleet_pass(
        store,
        namespaces=namespaces,
        pass_cfg=pc,
        sim_cfg=sc,
        runner=rc,
        merge=merge,
        reflect=reflect,
        wall_h=hours_now(),
        dry_run=pc.dry_run,
    )
    stats, commit = res["stats"], res["commit"]
    stats.time_s["trigger"] = round(t_trigger, 4)
    if not pc.dry_run:
        _cleanup(store, commit, stats.time_s)
    out.update(
        ran=True,
        dry_run=pc.dry_run,
        commit=commit,
        stats=stats.as_dict(),
        base_version=res["base_version"],
        records_read=res["records_read"],
        fleet=res["fleet"],
    )
    return out
