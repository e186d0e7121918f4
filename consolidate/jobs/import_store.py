"""``consolidate-import``: build a store from LOCOMO observations, or add the memories of a
JSONL, Parquet or CSV file to a store (Hydra job; see ``consolidate/conf/import.yaml``)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from .cli import job
from .common import make_embedder, make_store, open_store, typed, user_errors


class _EmbedOnUse:
    """The configured embedder, loaded only if a file has no vectors."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def encode(self, texts: list[str]) -> Any:
        from ..config import EmbedderConfig

        return make_embedder(typed(self.cfg, "embedder", EmbedderConfig)).encode(texts)


def run_import(cfg: DictConfig) -> dict:
    """With ``cfg.file``: read it (:func:`~consolidate.sources.files.read_memories`) and
    append its memories to ``cfg.store.dir``, creating the store if there is none (nothing
    is written when any record is invalid). Without: build ``cfg.store.dir`` from LOCOMO if
    it is missing (``store.create`` null counts as true here). Returns the report (``{}``-like when the store existed and no file was
    given).

    Raises:
        ValueError, InvalidRecordsError, FileNotFoundError: a bad file (names the file and
            the line or id); see :func:`~consolidate.sources.files.read_memories`.
    """
    if not cfg.get("file"):
        if cfg.store.get("create") is None:  # building the store is what this job is for
            from omegaconf import open_dict

            with open_dict(cfg):
                cfg.store.create = True
        store, report = open_store(cfg)
        head = store.head()
        return {"store": str(store.root), "version": head.version, **(report or {})}
    from ..config import StoreConfig
    from ..sources import read_memories
    from ..store import StoreNotFoundError

    got = read_memories(cfg.file, namespace=str(cfg.namespace), embedder=_EmbedOnUse(cfg))
    try:
        store, _ = open_store(cfg, build=False)  # checks store.name first
        created = False
    except StoreNotFoundError:
        store, created = make_store(typed(cfg, "store", StoreConfig)), True
    if created:
        store.create(got.records, source=got.path)
    else:
        store.append(got.records)
    return {
        "store": str(store.root),
        "version": store.head().version,
        "file": got.path,
        "memories": len(got.records),
        "created": created,
        "embedded": got.embedded,
        "generated_ids": got.generated_ids,
        "ignored_columns": got.ignored_columns,
    }


def import_message(out: dict[str, Any]) -> str:
    """The line ``consolidate-import`` prints for what :func:`run_import` returned: a file
    read into a store, a LOCOMO store built (its import report names the LOCOMO file too),
    or a store that existed already."""
    if "memories" in out:
        how = "built" if out["created"] else "added to"
        extra = [f"{out['generated_ids']} ids generated"] if out["generated_ids"] else []
        if out["embedded"]:
            extra.append("texts embedded")
        if out["ignored_columns"]:
            extra.append(f"columns ignored: {', '.join(out['ignored_columns'])}")
        return (
            f"{how} {out['store']} (version {out['version']}): {out['memories']} memories "
            f"from {out['file']}" + (f" ({'; '.join(extra)})" if extra else "")
        )
    if "observations" in out:
        return (
            f"built {out['store']}: {out['observations']} memories from "
            f"{out['conversations']} conversations; {len(out['malformed_evidence'])} with "
            f"malformed evidence (kept, listed in import_report.json)"
        )
    return f"{out['store']} already exists (snapshot {out['version']}); nothing to do"


@job("import")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``consolidate-import``: :func:`run_import`, then what was
    imported."""
    with user_errors():
        out = run_import(cfg)
    print(import_message(out))


if __name__ == "__main__":
    main()
