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
from ..write_path import IngestConfig, ingest
from .cli import job
from .common import make_embedder, make_store, sim_cfg, typed, user_errors


def run_ingest(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Read turns, run :func:`consolidate.write_path.ingest`, write ``ingest_summary.json``
    and ``ingest_log.jsonl`` (every decision with the raw model answer) to ``out_dir``."""
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
    with user_errors():
        out = run_ingest(cfg, HydraConfig.get().runtime.output_dir)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
