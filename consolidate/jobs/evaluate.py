"""``consolidate-evaluate``: evidence recall on LOCOMO before and after consolidation, with
the ablation table (Hydra job).

One run builds the LOCOMO observations store in memory, embeds the questions once, and for
each variant (no consolidation, hash-only, the full pass at several thresholds, decay off)
runs the pass with "now" = the date of each conversation's last session, then retrieves for
every question. It answers: how much smaller can the store get before recall drops?
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..config import EmbedderConfig, PassConfig, StoreConfig
from ..evaluation.metrics import category_label
from ..evaluation.plots import plot_ablation
from ..evaluation.results import Metric, Results, TaskInfo, environment, now_iso, write_results
from ..evaluation.retrieval import conversation_of, latency_ms, retrieval_table, summarise
from ..evaluation.tasks import TASKS, load_locomo_qa, verify
from ..sleep import run_pass
from ..store.batch import resolve_device
from .common import CONFIG_DIR, make_embedder, sim_cfg, typed

log = logging.getLogger("consolidate")

_LOWER_IS_BETTER = ("tokens@", "store_size", "p50_ms", "p95_ms")


def _variant_pass(base: PassConfig, overrides: dict[str, Any], name: str) -> PassConfig:
    try:
        return PassConfig(**{**base.__dict__, **overrides})
    except TypeError as e:
        raise ValueError(f"variant {name!r}: {e}") from None


def run_evaluate(cfg: DictConfig, out_dir: str | Path | None = None) -> Results:
    """Run every variant and write results.json, samples.jsonl, report.md and ablation.png.

    Args:
        cfg: composed ``evaluate`` config.
        out_dir: output folder (default: Hydra's run dir).

    Returns:
        The :class:`~consolidate.evaluation.results.Results` written.
    """
    from ..store.locomo import locomo_records

    out = Path(out_dir or HydraConfig.get().runtime.output_dir)
    timings: dict[str, float] = {}
    t0 = t = time.perf_counter()
    spec = TASKS["locomo10"]
    shas = verify(spec, cfg.paths.data_dir, cfg.allow_hash_mismatch)
    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    ecfg: EmbedderConfig = typed(cfg, "embedder", EmbedderConfig)
    emb = make_embedder(ecfg)
    recs, _ = locomo_records(scfg.locomo_file, emb, scfg.importance, scfg.conversations)
    qa = load_locomo_qa(scfg.locomo_file).to_pandas()
    convs = {conversation_of(n) for n in recs.meta["namespace"]}
    qa = qa[qa["conversation"].isin(convs)].reset_index(drop=True)
    q_vecs = emb.encode(qa["question"].tolist())
    timings["build_and_embed"] = time.perf_counter() - t
    now_conv = qa.groupby("conversation")["now_h"].max().to_dict()
    now_ns = {n: now_conv[conversation_of(n)] for n in set(recs.meta["namespace"])}
    base_pass = typed(cfg, "pass", PassConfig)
    sc = sim_cfg(cfg)
    merger = instantiate(cfg.merge)
    ks, budgets = list(cfg.ks), list(cfg.budgets)
    metric_cols = ([f"recall@{k}" for k in ks] + [f"recall@{b}tok" for b in budgets]
                   + [f"tokens@{cfg.tokens_at_k}"])
    ablation, samples, metrics = [], [], []
    for v in cfg.variants:
        name = v["name"]
        t = time.perf_counter()
        if v.get("consolidate", True):
            pc = _variant_pass(base_pass, OmegaConf.to_container(v.get("pass", {})), name)
            res = run_pass(recs, cfg=pc, sim_cfg=sc, merger=merger, version=2,
                           wall_h=max(now_conv.values()), now_by_namespace=now_ns)
            live = res.records.mask(res.records.live_mask())
            stats = res.stats
        else:
            live, stats = recs, {"merges": 0, "exact_merges": 0, "dropped_floor": 0,
                                 "dropped_cap": 0, "model_calls": 0}
        t_pass = time.perf_counter() - t
        tok = emb.count_tokens(live.meta["text"].tolist())
        table = retrieval_table(live, qa, q_vecs, tok, ks=ks, budgets=budgets,
                                tokens_at_k=cfg.tokens_at_k, retrieve_k=cfg.retrieve_k,
                                device=sc.device)
        lat = latency_ms(live, qa, q_vecs, max(ks), sample=cfg.latency_sample, seed=cfg.seed,
                         device=sc.device)
        summ = summarise(table, metric_cols)
        row = {"variant": name, "store_size": len(live),
               "merges": stats["merges"] + stats["exact_merges"],
               "dropped": stats["dropped_floor"] + stats["dropped_cap"],
               "model_calls": stats["model_calls"], "pass_s": round(t_pass, 3),
               "mean_memory_tokens": float(tok.mean()) if len(tok) else 0.0,
               **{c: summ.iloc[0][c] for c in metric_cols}, **lat}
        ablation.append(row)
        for _, s in summ.iterrows():
            cat = None if s["category"] == "all" else int(s["category"])
            for c in metric_cols:
                metrics.append(Metric(
                    name=c, value=None if pd.isna(s[c]) else float(s[c]),
                    higher_is_better=not c.startswith(_LOWER_IS_BETTER), variant=name,
                    category=cat, category_label=None if cat is None else category_label(cat),
                    n=int(s["n"])))
        for c in ("store_size", "p50_ms", "p95_ms"):
            metrics.append(Metric(name=c, value=float(row[c]), higher_is_better=False,
                                  variant=name, n=len(qa)))
        for r in table.to_dict("records"):
            samples.append({"variant": name, **r})
        log.info("%s: %d memories, recall@10 %.4f", name, len(live), row.get("recall@10", 0))
    timings["total"] = time.perf_counter() - t0
    abl = pd.DataFrame(ablation)
    per_cat = pd.DataFrame([
        {"variant": m.variant, "category": m.category_label, "metric": m.name, "value": m.value}
        for m in metrics if m.category is not None
    ])
    results = Results(
        job="evaluate", created_at=now_iso(),
        task=TaskInfo(name=spec.name, version=spec.version, files_sha256=shas,
                      hash_verified=all(shas[f] == h for f, h in spec.files.items()),
                      counts={"observations": len(recs), "questions": len(qa),
                              "conversations": len(convs)}, main_score=spec.main_score),
        config=OmegaConf.to_container(cfg, resolve=False),
        **environment(str(resolve_device(sc.device))),
        timings_s={k: round(x, 3) for k, x in timings.items()},
        metrics=metrics,
        tables={"ablation": abl.round(4).to_dict("records"),
                "per_category": per_cat.round(4).to_dict("records")},
    )
    report = _report(results, abl, per_cat, metric_cols)
    write_results(out, results, samples, report)
    plot_ablation(abl, out / "ablation.png",
                  [f"recall@{k}" for k in ks] + [f"recall@{b}tok" for b in budgets])
    return results


def _report(res: Results, abl: pd.DataFrame, per_cat: pd.DataFrame, cols: list[str]) -> str:
    show = ["variant", "store_size", "merges", "dropped"] + cols + ["p50_ms", "p95_ms"]
    lines = [
        f"# Evaluation: {res.task.name} {res.task.version}", "",
        f"- created {res.created_at}; git {res.git_commit}; device {res.device}",
        f"- data sha256 verified: {res.task.hash_verified}; counts {res.task.counts}",
        "- evidence recall = share of a question's evidence dia_ids covered by the source_ids "
        "of the retrieved memories; `@Ntok` = retrieval cut at N injected tokens "
        "(MiniLM tokenizer).", "",
        "## Ablation (all questions)", "", abl[show].round(4).to_markdown(index=False), "",
        "## Per category (LOCOMO code, LOCOMO name / Mem0 name)", "",
    ]
    if len(per_cat):
        piv = per_cat.pivot_table(index=["variant", "category"], columns="metric",
                                  values="value").reset_index()
        lines.append(piv.round(4).to_markdown(index=False))
    return "\n".join(lines) + "\n"


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    res = run_evaluate(cfg)
    abl = pd.DataFrame(res.tables["ablation"])
    cols = ["variant", "store_size", "recall@1", "recall@10", "recall@500tok",
            f"tokens@{cfg.tokens_at_k}"]
    print(abl[[c for c in cols if c in abl]].to_string(index=False))
    print(f"results in {HydraConfig.get().runtime.output_dir}")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
