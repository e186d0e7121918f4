"""The ablation run of ``consolidate-evaluate``: the task's memories (or an external
store's) through every variant of the pass, recall@k and token budgets per variant, the
results files and the report (:func:`run_evaluate`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..config import EmbedderConfig, PassConfig, SourceConfig, StoreConfig
from ..device import resolve_device
from ..factory import make_embedder, sim_cfg, typed
from ..pipeline import run_pass
from ..recall import fit_token_cap
from ..store.schema import InvalidRecordsError, Records, records_from_rows, validate
from ..store.vectors import check_vector_dtype, stored_vectors
from .results import (
    Metric,
    Results,
    TaskInfo,
    environment,
    hashes_verified,
    now_iso,
    prompt_versions,
    write_results,
)
from .retrieval import (
    faithful_source_ids,
    latency_ms,
    origin_texts,
    retrieval_table,
    summarise,
)
from .tasks import TASKS, MemoryTask, locomo_task, longmemeval_task

log = logging.getLogger("consolidate")

_LOWER_IS_BETTER = ("tokens@", "store_size", "p50_ms", "p95_ms")


def build_task(cfg: DictConfig, scfg: StoreConfig) -> MemoryTask:
    """The :class:`~consolidate.evaluation.tasks.MemoryTask` named by ``cfg.task``."""
    if cfg.task == "locomo10":
        return locomo_task(
            scfg.locomo_file,
            cfg.paths.data_dir,
            cfg.allow_hash_mismatch,
            scfg.conversations,
            scfg.importance,
        )
    if cfg.task == "longmemeval-fixture":
        return longmemeval_task(
            Path(__file__).resolve().parents[1] / "evaluation" / "longmemeval_tiny.json",
            TASKS["longmemeval-fixture"],
            cfg.allow_hash_mismatch,
        )
    if cfg.task == "longmemeval":
        return longmemeval_task(cfg.longmemeval_file, None, True)
    raise ValueError(f"task must be locomo10, longmemeval-fixture or longmemeval; got {cfg.task!r}")


def read_source(
    src: SourceConfig,
    emb: Any,
    groups: set[str],
    memory_group: Any,
    evidence: set[str] | None = None,
) -> tuple[Records, str]:
    """The live memories of an external source (``source=pgvector|mem0|jsonl``; read
    only, nothing is ever applied) as the evaluation's memories: their stored vectors and
    provenance (``source_ids``, matched against the questions' evidence).

    Args:
        src: the source's config.
        emb: the embedder of the questions (its dimension must be the vectors').
        groups: the question groups of the task (LOCOMO: conversations).
        memory_group: a memory's namespace -> the group that may see it.
        evidence: the questions' evidence ids (``None``: not checked).

    Returns:
        ``(records, the source's name)``.

    Raises:
        ValueError: no memory, vectors of another dimension than the embedder's, no
            memory with provenance, no namespace of the task's groups, or no provenance id
            among the questions' evidence (each names the source).
    """
    from ..sources.open import open_source

    source, name = open_source(src, lambda: emb)
    recs = source.records(source.read(src.namespaces))
    recs = recs.mask(recs.live_mask())
    if not len(recs):
        raise ValueError(f"{name}: no live memory to evaluate")
    if recs.dim != emb.dim:
        raise ValueError(
            f"{name}: its vectors have d={recs.dim} but the embedder "
            f"({emb.path}) gives d={emb.dim}: evaluate with the model that "
            f"embedded them (embedder.model_path=...)"
        )
    if not recs.meta["source_ids"].map(len).any():
        raise ValueError(
            f"{name}: no memory has provenance (source_ids), which recall is "
            f"measured against (pgvector: source.columns.source_ids=COLUMN; "
            f"Mem0: the metadata key source_ids)"
        )
    seen = {memory_group(n) for n in pd.unique(recs.meta["namespace"])}
    if not seen & groups:
        raise ValueError(
            f"{name}: none of its namespaces ({sorted(seen)[:5]}) belongs to "
            f"a question group of the task ({sorted(groups)[:5]})"
        )
    if evidence is not None:
        have = set(recs.meta["source_ids"].explode().dropna())
        if not have & evidence:
            raise ValueError(
                f"{name}: none of its provenance ids (e.g. {sorted(have)[:3]}) "
                f"is evidence of a question of the task (e.g. "
                f"{sorted(evidence)[:3]}): every recall would be 0"
            )
    return recs, name


def _variant_pass(base: PassConfig, overrides: dict[str, Any], name: str) -> PassConfig:
    try:
        return PassConfig(**{**base.__dict__, **overrides})
    except TypeError as e:
        raise ValueError(f"variant {name!r}: {e}") from None


def run_evaluate(
    cfg: DictConfig,
    out_dir: str | Path | None = None,
    splits: dict[str, Any] | Any | None = None,
) -> Results:
    """Run every variant and write results.json, samples.jsonl, report.md and ablation.png.

    Phases: build the task's store and embed its memories and questions
    (:class:`_Evaluation`), then per variant its store (:meth:`_Evaluation.variant_store`:
    the pass, an existing store, or the records as they are) and its scores
    (:meth:`_Evaluation.score`: retrieval, latency, answers), then the results.

    Args:
        cfg: composed ``evaluate`` config.
        out_dir: output folder (default: Hydra's run dir).
        splits: split name -> question groups (LOCOMO: conversations), or a function from
            the task's sorted groups to such a dict (recorded in ``tables["splits"]``, one
            row per split with its groups and question count);
            each ablation row
            then also has every metric over that split's questions alone, as
            ``<metric>[<split>]`` (the pass still runs over the whole store: it works per
            namespace, so a split's memories are consolidated as they would be alone).

    Returns:
        The :class:`~consolidate.evaluation.results.Results` written.
    """
    out = Path(out_dir or HydraConfig.get().runtime.output_dir)
    ev = _Evaluation(cfg, splits)
    for v in cfg.variants:
        t = time.perf_counter()
        live, stats, vdt = ev.variant_store(v)
        ev.score(v, live, stats, vdt, time.perf_counter() - t)
    ev.timings["total"] = time.perf_counter() - ev.t0
    results, abl, per_cat = ev.results()
    report = _report(results, abl, per_cat, ev.metric_cols)
    write_results(out, results, ev.samples, report)
    from .plots import plot_ablation

    plot_ablation(
        abl,
        out / "ablation.png",
        [f"faithful_recall@{k}" for k in ev.ks] + [f"faithful_recall@{b}tok" for b in ev.budgets],
    )
    return results


_NO_PASS = {"merges": 0, "exact_merges": 0, "dropped_floor": 0, "dropped_cap": 0, "model_calls": 0}


class _Evaluation:
    """One :func:`run_evaluate` call: the task's records and questions embedded once, the
    rows, samples and metrics its variants add."""

    def __init__(self, cfg: DictConfig, splits: dict[str, Any] | Any | None) -> None:
        self.cfg = cfg
        self.timings: dict[str, float] = {}
        self.t0 = t = time.perf_counter()
        scfg: StoreConfig = typed(cfg, "store", StoreConfig)
        self.task = task = build_task(cfg, scfg)
        self.ecfg: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
        self.emb = emb = make_embedder(self.ecfg)
        src = typed(cfg, "source", SourceConfig) if "source" in cfg else SourceConfig()
        self.qa = qa = task.questions
        self.recs, self.source_name = self._records(src)
        self.splits = splits(sorted(set(qa["group"]))) if callable(splits) else splits
        self.q_vecs = emb.encode(qa["question"].tolist())
        self.timings["build_and_embed"] = time.perf_counter() - t
        self.now_group = qa.groupby("group")["now_h"].max().to_dict()
        self.now_ns = {
            n: self.now_group.get(task.memory_group(n), max(self.now_group.values()))
            for n in set(self.recs.meta["namespace"])
        }
        self.convs = set(qa["group"])
        self.base_pass = typed(cfg, "sleep", PassConfig)
        self.sc = sim_cfg(cfg)
        self.merger = instantiate(cfg.merge)
        self.ks, self.budgets = list(cfg.ks), list(cfg.budgets)
        self.metric_cols = (
            [f"faithful_recall@{k}" for k in self.ks]
            + [f"faithful_recall@{b}tok" for b in self.budgets]
            + [f"recall@{k}" for k in self.ks]
            + [f"recall@{b}tok" for b in self.budgets]
            + [f"tokens@{cfg.tokens_at_k}"]
        )
        # what each provenance id's memory said before any pass (faithful recall's reference)
        self.origin = origin_texts(self.recs)
        self.ablation: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.metrics: list[Metric] = []
        self.acfg = acfg = cfg.answer
        self.backend, self.judge, self.answer_sample = None, None, None
        if acfg.backend:
            self.backend, self.judge = _backends(acfg)
            sample = qa.sample(n=min(int(acfg.questions), len(qa)), random_state=cfg.seed)
            sample = sample.sort_index()
            # LOCOMO's per-category F1 rules apply to LOCOMO only; other tasks: plain token F1
            sample["score_category"] = sample["category"] if cfg.task == "locomo10" else 4
            self.answer_sample = sample

    def _records(self, src: Any) -> tuple[Records, str | None]:
        """The task's memories embedded (``source=store``), or an external source's rows."""
        task, emb, qa = self.task, self.emb, self.qa
        if src.kind != "store":
            groups, evidence = set(qa["group"]), set(qa["evidence"].explode().dropna())
            return read_source(src, emb, groups, task.memory_group, evidence)
        vecs = emb.encode([m["text"] for m in task.memories])
        recs = records_from_rows(
            [
                {**m, "vector": vecs[k], "last_used": m["created_at"]}
                for k, m in enumerate(task.memories)
            ],
            dim=emb.dim,
        )
        problems = validate(recs, dim=emb.dim)
        if problems:
            raise InvalidRecordsError(f"task {task.spec.name}", problems)
        return recs, None

    def label(self, c: int) -> str:
        names = self.task.category_names
        return names.get(c, str(c)) if self.cfg.task == "locomo10" else f"{c} {names.get(c, '?')}"

    def variant_store(self, v: Any) -> tuple[Records, Any, str]:
        """The live records variant ``v`` evaluates, its pass's stats and its vector dtype:
        an existing store as it is (``store``), the task's records after the pass with the
        variant's settings, or the records as they are (``consolidate: false``)."""
        name, recs = v["name"], self.recs
        vdt = v.get("vectors", "fp32")
        try:
            base = (
                recs
                if vdt == "fp32"
                else Records(recs.meta, stored_vectors(recs.vectors, check_vector_dtype(vdt)))
            )
        except ValueError as e:
            raise ValueError(f"variant {name!r}: vectors: {e}") from None
        if v.get("store"):
            # evaluate an existing store as it is (e.g. the one `consolidate` maintains)
            from ..store.lance import open_store_dir

            snap = open_store_dir(v["store"]).load()
            return snap.records.mask(snap.records.live_mask()), dict(_NO_PASS), vdt
        if not v.get("consolidate", True):
            return base, dict(_NO_PASS), vdt
        pc = _variant_pass(
            self.base_pass, OmegaConf.to_container(v.get("sleep", v.get("pass", {}))), name
        )
        res = run_pass(
            base,
            cfg=pc,
            sim_cfg=self.sc,
            merger=self.merger,
            version=2,
            wall_h=max(self.now_group.values()),
            now_by_namespace=self.now_ns,
        )
        return res.records.mask(res.records.live_mask()), res.stats, vdt

    def score(self, v: Any, live: Records, stats: Any, vdt: str, t_pass: float) -> None:
        """Variant ``v``'s retrieval table, latency, ablation row, metrics and samples (and
        its answers, when the answer backend covers it)."""
        cfg, qa, ks, name = self.cfg, self.qa, self.ks, v["name"]
        tok = self.emb.count_tokens(live.meta["text"].tolist())
        table = retrieval_table(
            live,
            qa,
            self.q_vecs,
            tok,
            memory_group=self.task.memory_group,
            ks=ks,
            budgets=self.budgets,
            tokens_at_k=cfg.tokens_at_k,
            retrieve_k=cfg.retrieve_k,
            device=self.sc.device,
            faithful_sources=faithful_source_ids(live, self.origin),
        )
        lat = latency_ms(
            live,
            qa,
            self.q_vecs,
            max(ks),
            sample=cfg.latency_sample,
            seed=cfg.seed,
            device=self.sc.device,
            memory_group=self.task.memory_group,
        )
        summ = summarise(table, self.metric_cols, self.label)
        by_split = {}
        for sname, sgroups in (self.splits or {}).items():
            part = table[qa["group"].isin(set(sgroups)).to_numpy()]
            by_split |= {f"{c}[{sname}]": float(part[c].mean()) for c in self.metric_cols}
        row = {
            "variant": name,
            "vectors": "store" if v.get("store") else vdt,
            "store_size": len(live),
            "merges": stats["merges"] + stats["exact_merges"],
            "dropped": stats["dropped_floor"] + stats["dropped_cap"],
            "model_calls": stats["model_calls"],
            "pass_s": round(t_pass, 3),
            "mean_memory_tokens": float(tok.mean()) if len(tok) else 0.0,
            "store_tokens": int(tok.sum()),
            **{c: summ.iloc[0][c] for c in self.metric_cols},
            **by_split,
            **lat,
            # share of questions whose k reaches the whole pool: full context
            **{f"full_context@{k}": round(float((table["pool"] <= k).mean()), 4) for k in ks},
        }
        self.ablation.append(row)
        self._metrics(name, summ, row)
        if self.backend is not None and name in self.acfg.variants:
            self._answers(name, row, table, live)
        for r in table.to_dict("records"):
            self.samples.append({"variant": name, **r})
        log.info(
            "%s: %d memories, faithful recall@10 %.4f (provenance %.4f)",
            name,
            len(live),
            row.get("faithful_recall@10", 0),
            row.get("recall@10", 0),
        )

    def _metrics(self, name: str, summ: pd.DataFrame, row: dict[str, Any]) -> None:
        """The variant's metrics: each retrieval column overall and per category, then the
        store's size, tokens and latency."""
        for _, s in summ.iterrows():
            cat = None if s["category"] == "all" else int(s["category"])
            for c in self.metric_cols:
                self.metrics.append(
                    Metric(
                        name=c,
                        value=None if pd.isna(s[c]) else float(s[c]),
                        higher_is_better=not c.startswith(_LOWER_IS_BETTER),
                        variant=name,
                        category=cat,
                        category_label=None if cat is None else self.label(cat),
                        n=int(s["n"]),
                    )
                )
        for c in ("store_size", "store_tokens", "p50_ms", "p95_ms"):
            if c not in row:
                continue  # no latency sample
            self.metrics.append(
                Metric(
                    name=c,
                    value=float(row[c]),
                    higher_is_better=False,
                    variant=name,
                    n=len(self.qa),
                )
            )

    def _answers(self, name: str, row: dict[str, Any], table: Any, live: Records) -> None:
        """Answer and judge the question sample from the variant's retrieved memories."""
        assert self.backend is not None and self.judge is not None
        acfg, sample, backend, judge = self.acfg, self.answer_sample, self.backend, self.judge
        assert sample is not None
        t = time.perf_counter()
        scores = _answer(
            backend, judge, acfg, sample, table, live, self.emb, self.qa, self.cfg.seed
        )
        self.timings[f"answer_{name}"] = time.perf_counter() - t
        row.update(
            {
                **scores.summary,
                "answered": len(sample),
                "answer_model": backend.model,
                "judge_model": judge.model,
            }
        )
        for c, val in scores.summary.items():
            self.metrics.append(
                Metric(
                    name=c,
                    value=val,
                    variant=name,
                    higher_is_better=c in _ANSWER_HIGHER,
                    n=len(sample),
                )
            )
        for cat, g in scores.table.groupby("category"):
            for c in ("locomo_f1", "mem0_f1", "bleu1", "judge"):
                vals = g[c].dropna()  # judge: questions with a valid verdict only
                self.metrics.append(
                    Metric(
                        name=c,
                        value=float(vals.mean()) if len(vals) else None,
                        variant=name,
                        higher_is_better=True,
                        category=int(cat),
                        category_label=self.label(int(cat)),
                        n=len(vals),
                    )
                )
        for r in scores.table.to_dict("records"):
            self.samples.append({"variant": name, "kind": "answer", **r})

    def results(self) -> tuple[Results, pd.DataFrame, pd.DataFrame]:
        """The :class:`Results` of every variant, the ablation table and the per-category
        table."""
        task, qa, spec, splits = self.task, self.qa, self.task.spec, self.splits
        abl = pd.DataFrame(self.ablation)
        per_cat = pd.DataFrame(
            [
                {
                    "variant": m.variant,
                    "category": m.category_label,
                    "metric": m.name,
                    "value": m.value,
                }
                for m in self.metrics
                if m.category is not None
            ]
        )
        split_rows = [
            {"split": k, "groups": sorted(v), "questions": int(qa["group"].isin(set(v)).sum())}
            for k, v in (splits or {}).items()
        ]
        results = Results(
            job="evaluate",
            created_at=now_iso(),
            task=TaskInfo(
                name=spec.name,
                version=spec.version,
                files_sha256=task.shas,
                hash_verified=hashes_verified(spec.files, task.shas),
                counts={
                    "memories": len(self.recs),
                    "questions": len(qa),
                    "groups": len(self.convs),
                    "truncated_texts": int(getattr(self.emb, "truncated", 0)),
                },
                main_score=spec.main_score,
                memories_from=self.source_name,
            ),
            config=OmegaConf.to_container(self.cfg, resolve=False),
            **environment(str(resolve_device(self.sc.device))),
            timings_s={k: round(x, 3) for k, x in self.timings.items()},
            metrics=self.metrics,
            tables={
                "ablation": abl.round(4).to_dict("records"),
                "per_category": per_cat.round(4).to_dict("records"),
                **({"splits": split_rows} if splits else {}),
            },
            prompts=prompt_versions(),
            models=self._models(),
        )
        return results, abl, per_cat

    def _models(self) -> dict[str, str]:
        merger, backend, judge = self.merger, self.backend, self.judge
        return {
            "embedder": str(getattr(self.emb, "path", self.ecfg.name)),
            "merger": str(getattr(merger, "model", None) or getattr(merger, "name", "")),
            **(
                {"answer": str(backend.model), "judge": str(judge.model)}  # type: ignore[union-attr]
                if backend is not None
                else {}
            ),
        }


_ANSWER_HIGHER = ("locomo_f1", "mem0_f1", "bleu1", "judge", "judge_ci_low", "judge_ci_high")


def _backends(acfg: Any) -> tuple[Any, Any]:
    """The answer backend and the judge backend (``answer.judge_backend``; the answer
    model judges itself only with ``answer.allow_same_judge``).

    Raises:
        ValueError: no judge backend, or the same model, without ``allow_same_judge``.
    """
    from ..llm import make_backend

    backend = make_backend(acfg.backend, **OmegaConf.to_container(acfg.backend_kwargs))
    if not acfg.judge_backend:
        if not acfg.allow_same_judge:
            raise ValueError(
                "answer.judge_backend is not set: the judge must be a model "
                "other than the answer model (answer.judge_backend=... with "
                "answer.judge_backend_kwargs, or answer.allow_same_judge=true)"
            )
        return backend, backend
    judge = make_backend(acfg.judge_backend, **OmegaConf.to_container(acfg.judge_backend_kwargs))
    if str(judge.model) == str(backend.model) and not acfg.allow_same_judge:
        raise ValueError(
            f"answer.judge_backend runs the answer model ({backend.model}): a "
            f"model grading its own answers is lenient; choose another model "
            f"or set answer.allow_same_judge=true"
        )
    return backend, judge


def _answer(
    backend: Any,
    judge: Any,
    acfg: Any,
    sample: pd.DataFrame,
    table: pd.DataFrame,
    live: Any,
    emb: Any,
    qa: pd.DataFrame,
    seed: int,
) -> Any:
    """Answer ``sample`` from this variant's retrieval (top memories within the token
    budget), then score and judge (see :mod:`consolidate.evaluation.answer`)."""
    from .answer import score_answers

    text_of = dict(zip(live.meta["id"], live.meta["text"], strict=True))
    top = dict(zip(table["qid"], table["top_ids"], strict=True))
    contexts = []
    for qid in sample["qid"]:
        texts = [text_of[i] for i in top[qid]]
        tok = emb.count_tokens(texts) if texts else np.zeros(0, np.int64)
        contexts.append(texts[: fit_token_cap(tok, acfg.budget_tokens)])
    return score_answers(
        backend,
        sample,
        contexts,
        qa,
        repeats=acfg.judge_repeats,
        temperature=acfg.judge_temperature,
        max_tokens=acfg.max_tokens,
        bootstrap=acfg.bootstrap,
        seed=seed,
        judge=judge,
    )


def full_context(abl: pd.DataFrame) -> dict[str, float]:
    """``recall@k`` -> the largest share of questions (over the variants) whose pool of
    memories is at most ``k``: for them recall@k measures the whole context, not retrieval."""
    out = {}
    for c in abl.columns:
        if c.startswith("full_context@") and len(abl) and float(abl[c].max()) > 0:
            out["recall@" + c.split("@", 1)[1]] = float(abl[c].max())
    return out


def _full_context_note(abl: pd.DataFrame) -> list[str]:
    full = full_context(abl)
    if not full:
        return []
    parts = ", ".join(f"{c} for {v:.0%} of questions" for c, v in full.items())
    return [
        f"Full context, not retrieval (k reaches every memory the question can see): "
        f"{parts}. Such columns leave the console headline when it is over half.",
        "",
    ]


def _report(res: Results, abl: pd.DataFrame, per_cat: pd.DataFrame, cols: list[str]) -> str:
    show = (
        ["variant", "vectors", "store_size", "store_tokens", "merges", "dropped"]
        + cols
        + [c for c in ("p50_ms", "p95_ms") if c in abl]
    )
    ans_cols = [
        c
        for c in (
            "locomo_f1",
            "mem0_f1",
            "bleu1",
            "judge",
            "judge_ci_low",
            "judge_ci_high",
            "judge_questions",
            "judge_invalid_rate",
            "judge_wrong_answer_acceptance",
            "model_calls",
        )
        if c in abl
    ]
    if "answered" not in abl:
        ans_cols = []
    lines = [
        f"# Evaluation: {res.task.name} {res.task.version}",
        "",
        f"- created {res.created_at}; git {res.git_commit}; device {res.device}",
        f"- data sha256 verified: {res.task.hash_verified}; counts {res.task.counts}",
        *(
            [
                f"- memories read from {res.task.memories_from} (stored vectors and provenance; "
                f"the pass runs on a copy, nothing is written to the source)"
            ]
            if res.task.memories_from
            else []
        ),
        "- `faithful_recall` (the headline) = share of a question's evidence ids whose "
        "original text survives in the text of a retrieved memory (the pass's fidelity "
        "checker, `consolidate.ops.fidelity`): it sees a merge that drops what a member said. "
        "`recall` = provenance recall, the share covered by the retrieved memories' "
        "source_ids whatever their text says: it measures retrieval alone. `@Ntok` = "
        "retrieval cut at N injected tokens (MiniLM tokenizer).",
        "",
        "## Ablation (all questions)",
        "",
        abl[show].round(4).to_markdown(index=False),
        "",
        *_full_context_note(abl),
        "## Per category (for LOCOMO: code, LOCOMO name / Mem0 name)",
        "",
    ]
    if ans_cols:
        model = res.config.get("answer", {})
        lines[-2:-2] = [
            "## Answers (model backend)",
            "",
            f"answers by {model.get('backend')} ({abl['answer_model'].dropna().iloc[0]}), "
            f"judged by {abl['judge_model'].dropna().iloc[0]}; "
            f"{int(abl['answered'].dropna().iloc[0])} sampled questions. `judge` is the "
            "share of CORRECT among valid verdicts, over the `judge_questions` questions with "
            "one; invalid verdicts (anything but the JSON label) count neither way and their "
            "share is `judge_invalid_rate`; the judge's acceptance of deliberately wrong "
            "answers is the leniency control.",
            "",
            abl[abl["answered"].notna()][["variant", *ans_cols]].round(4).to_markdown(index=False),
            "",
        ]
    if len(per_cat):
        piv = per_cat.pivot_table(
            index=["variant", "category"], columns="metric", values="value"
        ).reset_index()
        lines.append(piv.round(4).to_markdown(index=False))
    return "\n".join(lines) + "\n"
