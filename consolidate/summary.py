"""The table a ``consolidate`` run prints (and writes to its log), from the run's summary
dict: :func:`format_summary`."""

from __future__ import annotations

from typing import Any

__all__ = ["format_summary"]


def format_summary(s: dict[str, Any]) -> str:
    """The short table printed at the end of a ``consolidate`` run, from its summary dict
    (``summary.json``): the store, the import, the trigger, the policy, then the pass's
    stages, what was written (a store's version, or an external source's plan) and the
    runner."""
    lines = [f"store            {s['store']}", *_import_lines(s), _trigger_line(s["trigger"])]
    lines.append(_policy_line(s))
    if s.get("refused_deltas"):
        lines.append(
            f"refused deltas   {len(s['refused_deltas'])} moved to quarantine/ (failed their "
            f"checksum or the write rules; each named in summary.json)"
        )
    if not s.get("ran"):
        tr = s.get("trigger") or {}
        if tr.get("fired") or tr.get("forced"):
            lines.append("pass             skipped (no memories to pass)")
        else:
            lines.append(
                "pass             skipped (the trigger above did not fire; "
                "sleep.force=true runs anyway)"
            )
    else:
        st = s["stats"]
        lines.append(f"{'stage':<17}{'result':<44}time_s")
        lines += [f"{a:<17}{b!s:<44}{t}" for a, b, t in _stage_rows(st)]
        lines += _external_lines(s) if "external" in s else [_commit_line(s["commit"])]
        lines.append(
            f"device           {st['device']}, engine {st.get('engine', 'torch')} "
            f"(merger: {st['merger']})"
        )
        if "fleet" in s:
            lines += _fleet_lines(s["fleet"])
    lines.append(f"wall time        {s['wall_time_s']} s; summary {s['summary_path']}")
    return "\n".join(lines)


def _import_lines(s: dict[str, Any]) -> list[str]:
    """The import's line (and its problems' line) when the run built the store."""
    if "import" not in s:
        return []
    i = s["import"]
    lines = [
        f"imported         {i['observations']} observations from "
        f"{i['conversations']} conversations ({i['time_s']} s)"
    ]
    problems = {k: i[k] for k in ("malformed_evidence", "malformed_items", "bad_times") if i.get(k)}
    if problems:
        lines.append(f"import problems  {problems} (listed in import_report.json)")
    return lines


def _trigger_line(tr: dict[str, Any]) -> str:
    """Whether the nightly trigger fired, store-wide or per namespace."""
    per_ns = (
        f" in {tr['namespaces_fired']} of {tr['namespaces_with_new']} namespaces with new memories"
        if tr.get("namespaces_with_new")
        else " (no new memories since the last pass)"
        if "namespaces_fired" in tr
        else ""
    )
    return (
        f"trigger          new importance {tr['new_importance']} vs "
        f"{tr['threshold']}{' per namespace' if per_ns else ''}: "
        f"{'fired' if tr['fired'] else 'not fired'}{per_ns}"
        f"{' (forced)' if tr['forced'] else ''}"
    )


def _stage_rows(st: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(stage, result, seconds) per row of the stage table."""
    ts = st["time_s"]
    rows: list[tuple[str, Any, Any]] = [
        ("records in", st["records_in"], ts["load"]),
        (
            "exact duplicates",
            f"{st['exact_duplicates']} in {st['exact_groups']} groups",
            ts["exact"],
        ),
        ("pairs >= thresh", st["pairs"], ts["similarity"]),
        ("clusters", st["clusters"], ts["cluster"]),
        (
            "merges",
            f"{st['merges']} clusters + {st['exact_merges']} exact ({st['merged_members']} records)",
            ts["merge"],
        ),
        ("merge texts", _merge_texts(st), ""),
        ("review pairs", st["review_pairs"], ""),
        ("superseded", f"{st['superseded']} older facts closed (valid_to)", ""),
        (
            "dropped",
            f"{st['dropped_floor']} below floor, {st['dropped_cap']} over cap",
            ts["score"],
        ),
        ("records out", st["records_out"], ts["commit"]),
        (
            "model calls",
            _calls(st, "merge", st["model_calls"], "prompt_tokens", "completion_tokens"),
            "",
        ),
    ]
    if "reflections" in st:
        groups = f"{st['reflections']} of {st['reflect_groups']} groups"
        rows.insert(-2, ("reflections", groups, ts["reflect"]))
        calls = _calls(
            st, "reflect", st["reflect_calls"], "reflect_prompt_tokens", "reflect_completion_tokens"
        )
        rows.append(("reflect calls", calls, ""))
    return rows


def _external_lines(s: dict[str, Any]) -> list[str]:
    """What an external source's plan applied (or would), how to undo it, and its files."""
    g = s["external"]
    done = (
        ", ".join(f"{n} {k}{'' if n == 1 else 's'}" for k, n in sorted(g["applied"].items()))
        or "nothing"
    )
    lines = [
        f"{'would apply' if s['dry_run'] else 'applied':<17}{done} "
        f"(plan {g['plan_id'][:12]} in plan.json; {g['n_skipped']} units "
        f"skipped; events {g['events']})"
        + ("; source.apply=true writes it" if s["dry_run"] and g["applied"] else "")
    ]
    if not s["dry_run"] and g["applied"]:
        lines.append(
            f"{'undo':<17}consolidate-undo with the same source settings and "
            f"id={g['plan_id'][:12]} (the plan), id=last, or a merge's id"
        )
    if g.get("late"):
        acts: dict[str, int] = {}
        for x in g["late"]:
            acts[x["action"]] = acts.get(x["action"], 0) + 1
        n = len(g["late"])
        lines.append(
            f"{'late writes':<17}{n} unit{'' if n == 1 else 's'} of earlier applies written since: "
            + ", ".join(f"{n} {a}" for a, n in sorted(acts.items()))
            + " (listed in plan.json)"
        )
    if g.get("carried"):
        lines.append(
            f"{'appended lines':<17}{g['carried']} lines an agent appended during the pass, "
            f"carried into the file"
        )
    if s.get("records_without_vector"):
        lines.append(
            f"{'no vector yet':<17}{s['records_without_vector']} live rows "
            f"left out of the pass, untouched (named in the log)"
        )
    if g.get("version") is not None:
        lines.append(
            f"{'lance version':<17}{g['version']} written (the version "
            f"read, {g['previous_version']}, stays in the history)"
        )
    if g.get("written"):
        lines.append(
            f"{'result file':<17}{g['written']}"
            + (f" (the file as it was: {g['backup']})" if g.get("backup") else "")
        )
    return lines


def _commit_line(c: dict[str, Any]) -> str:
    """What the store's commit wrote: a version, nothing (unchanged), or a dry run."""
    if c.get("unchanged"):
        return f"written          nothing changed: no new version (still version {c['version']})"
    where = f"version {c['version']}" if c["snapshot"] else "dry run, nothing written"
    rows_w = f", {c['rows_written']} rows written" if "rows_written" in c else ""
    return (
        f"written          {where}, changelog {c['changelog']}{rows_w}, "
        f"carried {c['carried_records']} late records"
    )


def _fleet_lines(f: dict[str, Any]) -> list[str]:
    """A fleet run's shards, commits and LLM stage."""
    lines = [
        f"runner           ray: {f['shards']} shards of whole namespaces on "
        f"{f['workers']} actors, {f['ray_s']} s on Ray (stage times are "
        f"summed over actors)"
    ]
    if "commits" in f:
        lines.append(
            f"commits          {len(f['commits'])} versions "
            f"({', '.join(map(str, f['commits']))}), one per group of shards"
        )
    if "llm" in f:
        q = f["llm"]
        lines.append(
            f"llm stage        ray.data.llm: {q['requests']} requests in "
            f"{q['rounds']} rounds ({q['cached']} from the cache), "
            f"{q['seconds']} s"
        )
    return lines


def _policy_line(s: dict[str, Any]) -> str:
    """The retention policy the pass applied, and its measured cost when a ``policy.json``
    set it (else: uncalibrated)."""
    p = dict(s["config"].get("sleep", s["config"].get("pass", {})))
    if "calibration" in s:
        p["threshold"] = s["calibration"]["threshold"]
    pol = s.get("policy")
    if pol is not None and not pol.get("calibrated"):
        pol = None
    if pol is not None:
        p.update(pol["pass"])

    def num(x: Any) -> str:
        return f"{x:g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)

    cur = (
        f"threshold {num(p.get('threshold'))}, tau {num(p.get('tau_hours'))} h, floor "
        f"{num(p.get('floor'))}, cap {num(p.get('cap'))}"
    )
    if pol is None:
        if "calibration" in s:
            c = s["calibration"]
            return (
                f"policy           {cur}: threshold from {c.get('file', 'a calibration')}"
                f" ({c.get('rule', '?')} on {c.get('dataset', '?')}); tau, floor and cap "
                f"uncalibrated (consolidate-policy measures what they cost in recall)"
            )
        return (
            f"policy           {cur}: uncalibrated (consolidate-policy measures what a "
            f"policy costs in recall)"
        )
    held = (pol.get("held_out") or {}).get("keeps")
    keeps = ", ".join(f"{m} {v:.1%}" for m, v in (held or pol["keeps"]).items() if v is not None)
    task = (pol.get("task") or {}).get("name", "?") + (" (held-out half)" if held else "")
    return (
        f"policy           {cur} from {pol['file']}: on {task} it kept {keeps} of the "
        f"recall of keeping every memory, with {pol['tokens_vs_baseline']:.0%} of the "
        f"stored tokens (target {pol['target']['share']:.0%})"
    )


def _merge_texts(st: dict[str, Any]) -> str:
    """One line on the merged texts: length against the longest member, members lost (the
    fidelity checker's count over the committed merges) and merges it refused."""
    n = st.get("merges_losing_facts", 0)
    refused = f"members lost {st.get('members_lost', 0)}" + (
        f" ({n} merges refused by the fidelity check, {st.get('members_lost_refused', 0)} "
        f"members they would have lost)"
        if n
        else ""
    )
    if "merge_text_ratio_mean" not in st:
        return refused
    return (
        f"{st['merge_text_ratio_mean']:.2f}x the longest member on average (max "
        f"{st['merge_text_ratio_max']:.2f}x); {refused}"
    )


def _calls(st: dict[str, Any], stage: str, calls: int, pt: str, ct: str) -> str:
    """``N (P+C tokens, p50/p95 latency s)`` for one model stage of the summary table."""
    if not calls:
        return "0"
    out = f"{calls} ({st.get(pt, 0)}+{st.get(ct, 0)} tokens"
    if f"{stage}_latency_p50_s" in st:
        out += (
            f", p50 {st[f'{stage}_latency_p50_s']:.2f} s, p95 {st[f'{stage}_latency_p95_s']:.2f} s"
        )
    return out + ")"
