"""Results schema (pydantic) and writers: ``results.json``, ``samples.jsonl``, ``report.md``.

Every run records what is needed to reproduce and compare it: schema version, task name and
version, the sha256 of each data file read, the full config, git commit, package versions,
device and timings, and each metric with ``higher_is_better``.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..environment import environment

__all__ = [
    "SCHEMA_VERSION",
    "Metric",
    "TaskInfo",
    "Results",
    "environment",
    "write_results",
    "read_results",
]

SCHEMA_VERSION = 1


class Metric(BaseModel):
    """One number. ``variant``: ablation arm; ``category``: LOCOMO code (``None`` = all)."""

    name: str
    value: float | None
    higher_is_better: bool
    variant: str | None = None
    category: int | None = None
    category_label: str | None = None
    n: int = 0


class TaskInfo(BaseModel):
    """What was measured: the task's real name and version, every data file read (path ->
    its sha256 as read), whether each hash equals a declared one (``hash_verified``; a
    file given by path has none to compare with), counts, the headline metric, and where
    the memories came from (``memories_from``: ``None`` when the task's own were embedded
    in the run, else the external source they were read from, with their stored vectors)."""

    name: str
    version: str
    files_sha256: dict[str, str]
    hash_verified: bool
    counts: dict[str, int] = Field(default_factory=dict)
    main_score: str = ""
    memories_from: str | None = None


class Results(BaseModel):
    """The ``results.json`` every evaluation job writes (pydantic): what ran (job, task with
    its file hashes, config), where (commit, packages, device, Python), and its tables
    and scores."""

    schema_version: int = SCHEMA_VERSION
    job: str
    created_at: str
    task: TaskInfo
    config: dict[str, Any]
    git_commit: str | None
    packages: dict[str, str]
    device: str
    python: str
    timings_s: dict[str, float]
    metrics: list[Metric]
    tables: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    #: prompt name -> version of every prompt family the run could send
    prompts: dict[str, str] = Field(default_factory=dict)
    #: role (embedder, answer, judge, merger...) -> model id or path
    models: dict[str, str] = Field(default_factory=dict)


def prompt_versions() -> dict[str, str]:
    """The version of every prompt family in the package (recorded with each result, so
    runs made with different prompts are never compared unknowingly)."""
    from ..llm.decide import DECIDE_PROMPT_VERSION
    from ..llm.extract import EXTRACT_PROMPT_VERSION
    from ..llm.merger import CONFLICT_PROMPT_VERSION, MERGE_PROMPT_VERSION
    from ..llm.reflect import REFLECT_PROMPT_VERSION
    from .answer import PROMPT_VERSION as ANSWER_PROMPT_VERSION

    return {
        "extract": EXTRACT_PROMPT_VERSION,
        "decide": DECIDE_PROMPT_VERSION,
        "merge": MERGE_PROMPT_VERSION,
        "merge_conflict": CONFLICT_PROMPT_VERSION,
        "reflect": REFLECT_PROMPT_VERSION,
        "answer_judge": ANSWER_PROMPT_VERSION,
    }


def hashes_verified(declared: dict[str, str], read: dict[str, str]) -> bool:
    """Whether every file read has a declared sha256 and matches it (``declared`` keys are
    compared by file name, since a data folder may live anywhere)."""
    want = {Path(k).name: v for k, v in declared.items()}
    return bool(read) and all(
        want.get(Path(k).name) and want[Path(k).name] == v for k, v in read.items()
    )


def now_iso() -> str:
    """The wall clock in UTC as ISO 8601 with seconds (``2026-12-05T20:32:43+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_results(
    out_dir: str | Path, results: Results, samples: list[dict[str, Any]], report_md: str
) -> dict[str, Path]:
    """Write ``results.json``, ``samples.jsonl`` and ``report.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out / "results.json",
        "samples": out / "samples.jsonl",
        "report": out / "report.md",
    }
    paths["results"].write_text(results.model_dump_json(indent=1))
    with open(paths["samples"], "w") as f:
        for s in samples:
            f.write(json.dumps(s, default=float) + "\n")
    paths["report"].write_text(report_md)
    return paths


def read_results(path: str | Path) -> Results:
    """Parse a ``results.json``.

    Raises:
        ValueError: the file is not JSON in this schema (names the file and the first
            problem; e.g. the results of a benchmark script that predates the schema).
    """
    from pydantic import ValidationError

    try:
        return Results.model_validate_json(Path(path).read_text())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "(top level)"
        raise ValueError(
            f"{path} is not a results.json of this harness's schema ({e.error_count()} "
            f"problems; first: {where}: {first.get('msg')})"
        ) from None
