"""``consolidate-ingest``: the write path over LOCOMO dialogue turns (Hydra job).

Example: ``consolidate-ingest ingest.max_turns=20 store.dir=stores/ingested``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..config import EmbedderConfig, StoreConfig
from ..llm import make_backend
from ..store.locomo import read_locomo_turns
from .cli import job
from .common import make_embedder, make_store, sim_cfg, typed, user_errors


def run_ingest(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Read turns, run :func:`consolidate.ingest.ingest`, write ``ingest_summary.json``
    and ``ingest_log.jsonl`` (every decision with the raw model answer) to ``out_dir``."""
    from ..ingest import IngestConfig, ingest  # with torch: not for --help

    scfg: StoreConfig = typed(cfg, "store", StoreConfig)
    turns = read_locomo_turns(
        scfg.locomo_file, scfg.conversations, cfg.ingest.sessions, cfg.ingest.max_turns
    )
    backend = make_backend(cfg.ingest.backend, **OmegaConf.to_container(cfg.ingest.backend_kwargs))
    emb = make_embedder(typed(cfg, "embedder", EmbedderConfig))
    icfg = IngestConfig(
        **{
            k: cfg.ingest[k]
            for k in (
                "top_s",
                "add_below",
                "allow_untrusted",
                "require_grounding",
                "supersede_above",
                "extract_max_tokens",
                "decide_max_tokens",
            )
        }
    )
    out = ingest(make_store(scfg), turns, backend, emb, icfg, device=sim_cfg(cfg).device)
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    events = out.pop("events")
    with open(d / "ingest_log.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    (d / "ingest_summary.json").write_text(json.dumps(out, indent=1))
    return out


@job("ingest")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-ingest``: :func:`run_ingest` into the run's
    output folder, then its summary as JSON and the accounting line of every extracted
    fact."""
    with user_errors():
        out = run_ingest(cfg, HydraConfig.get().runtime.output_dir)
    out.pop("refused", None)  # the entries are in the refused-facts log
    print(json.dumps(out, indent=1))
    print(accounting_line(out["accounting"]))


def accounting_line(a: dict[str, Any]) -> str:
    """``facts: N extracted = a added + u updated (merged into a memory) + s superseding +
    n NOOP + r refused (reason k, ...)``, from the summary's ``accounting``."""
    why = ", ".join(f"{k} {v}" for k, v in sorted(a["refused_by_reason"].items()))
    line = (
        f"facts: {a['extracted']} extracted = {a['added']} added + {a['updated']} updated "
        f"(merged into a memory) + {a['superseding']} superseding + {a['noop']} NOOP + "
        f"{a['refused']} refused" + (f" ({why})" if why else "")
    )
    if a["turns_refused"]:
        line += "; turns refused: " + ", ".join(
            f"{k} {v}" for k, v in sorted(a["turns_refused"].items())
        )
    return line


if __name__ == "__main__":
    main()
