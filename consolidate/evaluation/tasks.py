"""Evaluation tasks: metadata (name, version, path, sha256, counts, main score) and loaders.

Files are read in place from ``paths.data_dir`` (``../shared/data`` here) and checked against
the sha256 declared below; a file whose hash differs is refused unless the caller passes
``allow_hash_mismatch=True`` (then the run records the hash it actually read).

Pairs (STS-B, SICK) and LongMemEval load through HF ``datasets`` from local files. LOCOMO is
read with ``json`` and handed to ``datasets.Dataset.from_list`` after its types are made
uniform: its answers are strings, integers or missing, and its evidence comes in several
shapes, which Arrow's schema inference rejects in the raw file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# local files only: never let `datasets` or the hub client reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

__all__ = [
    "TaskSpec",
    "MemoryTask",
    "DatasetHashError",
    "TASKS",
    "verify",
    "load_locomo_qa",
    "longmemeval_task",
    "locomo_task",
    "load_stsb",
    "load_sick",
    "load_longmemeval",
    "sha256_file",
]


@dataclass(frozen=True)
class TaskSpec:
    """Declared metadata of an evaluation task.

    Attributes:
        name, version: task identity (version bumps when the loader's output changes).
        files: paths relative to the data dir (or to the repo for fixtures) -> sha256.
        counts: expected counts (checked by the loaders).
        main_score: the headline metric name.
        source: citation and licence.
    """

    name: str
    version: str
    files: dict[str, str]
    counts: dict[str, int] = field(default_factory=dict)
    main_score: str = ""
    source: str = ""


TASKS: dict[str, TaskSpec] = {
    "locomo10": TaskSpec(
        "locomo10",
        "1.0",
        {
            "locomo/locomo10.json": "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"
        },
        {"conversations": 10, "observations": 2541, "qa": 1986},
        "evidence_recall@10",
        "Maharana et al., ACL 2024; CC BY-NC 4.0",
    ),
    "stsb": TaskSpec(
        "stsb",
        "1.0",
        {
            "pairs/stsb/sts-train.csv": "0f71910b59aa1ad973c5897f0791f3b0965a92b8f82b1a95f3eea9f4162fda82",
            "pairs/stsb/sts-dev.csv": "5d7e944d8b02734b07bfdb5df67db3420c64bed153fcaa1ba47ad03480cf4234",
            "pairs/stsb/sts-test.csv": "affe45928a66ee5a708531233c95b7dacbbdc57f974f002a3d32ea0180cf816a",
        },
        {"train": 5749, "dev": 1500, "test": 1379},
        "average_precision",
        "STS Benchmark (Cer et al., 2017); scores CC BY-SA 4.0; duplicate = score >= 4",
    ),
    "sick": TaskSpec(
        "sick",
        "1.0",
        {"pairs/sick/SICK.txt": "1539c2d059809b5bd40694e26d8121cc85b6b496f91c7b40f2fc83bbd7dcd957"},
        {"pairs": 9840, "mutual_entailment": 1300, "contradiction": 1424},
        "average_precision",
        "Marelli et al., LREC 2014; CC BY-NC-SA 3.0; duplicate = mutual entailment",
    ),
}


TASKS["longmemeval-fixture"] = TaskSpec(
    "longmemeval-fixture",
    "1.0",
    {
        "consolidate/evaluation/longmemeval_tiny.json": "695626ad1b6bc680970b06d5e83fc7e25972ca71ccd8653533e885acb95887cb"
    },
    {"questions": 3, "sessions": 7, "user_turns": 10},
    "evidence_recall@10",
    "a 3-question fixture in LongMemEval's format (Wu et al., 2024), written for this repo",
)


class DatasetHashError(ValueError):
    """A data file's sha256 differs from the task's declared one."""


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of the file at ``path`` (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(spec: TaskSpec, root: str | Path, allow_hash_mismatch: bool = False) -> dict[str, str]:
    """Check every file of ``spec`` under ``root``; return ``{relative path: sha256 read}``.

    Raises:
        FileNotFoundError: a file is missing (names it and the data dir setting).
        DatasetHashError: a hash differs and ``allow_hash_mismatch`` is false.
    """
    out = {}
    for rel, want in spec.files.items():
        p = Path(root) / rel
        if not p.exists():
            raise FileNotFoundError(
                f"{spec.name}: {p} not found (set paths.data_dir or CONSOLIDATE_DATA_DIR)"
            )
        got = sha256_file(p)
        if got != want and not allow_hash_mismatch:
            raise DatasetHashError(
                f"{spec.name} {spec.version}: {p} has sha256 {got}, expected {want}; pass "
                f"allow_hash_mismatch=true to evaluate on it anyway"
            )
        out[rel] = got
    return out


def load_locomo_qa(path: str | Path) -> Any:
    """LOCOMO questions as a ``datasets.Dataset``.

    Columns: ``conversation`` (sample_id), ``qid`` (``<sample_id>/q<k>``), ``question``,
    ``answer`` (str; ``""`` when absent), ``adversarial_answer`` (str or ``""``),
    ``category`` (int, LOCOMO codes), ``evidence`` (list of valid dia_ids),
    ``evidence_malformed`` (tokens that are not dia_ids), ``now_h`` (hours since the epoch
    of the conversation's last session: questions come after it).
    """
    import datasets

    from ..store.locomo import parse_evidence, parse_session_time

    data = json.loads(Path(path).read_text())
    rows = []
    for conv in data:
        sid = conv["sample_id"]
        times = []
        for k, v in conv["conversation"].items():
            if k.endswith("_date_time"):
                try:
                    times.append(parse_session_time(v).timestamp() / 3600)
                except ValueError:
                    continue
        now_h = max(times)
        for k, q in enumerate(conv["qa"]):
            good, bad = parse_evidence(q.get("evidence", []))
            rows.append(
                {
                    "conversation": sid,
                    "qid": f"{sid}/q{k}",
                    "question": str(q["question"]),
                    "answer": "" if q.get("answer") is None else str(q["answer"]),
                    "adversarial_answer": str(q.get("adversarial_answer") or ""),
                    "category": int(q["category"]),
                    "evidence": good,
                    "evidence_malformed": bad,
                    "now_h": float(now_h),
                }
            )
    return datasets.Dataset.from_list(rows)


_STSB_COLS = ["genre", "file", "years", "id", "score", "sentence1", "sentence2", "src1", "src2"]


def load_stsb(root: str | Path, split: str = "dev") -> Any:
    """STS-B split (``train``/``dev``/``test``) with ``sentence1``, ``sentence2``, ``score``
    (0-5) and ``label`` (1 when score >= 4). Tab-separated, no quoting, some rows carry two
    extra source columns."""
    import datasets

    ds = datasets.load_dataset(
        "csv",
        data_files={split: str(Path(root) / f"pairs/stsb/sts-{split}.csv")},
        delimiter="\t",
        quoting=3,
        header=None,
        names=_STSB_COLS,
        split=split,
    )
    return ds.map(lambda r: {"label": int(float(r["score"]) >= 4.0)})


def load_sick(root: str | Path, split: str | None = None) -> Any:
    """SICK pairs with ``label`` = 1 for mutual entailment (A entails B and B entails A) and
    ``contradiction`` = 1 when the pair's entailment label is CONTRADICTION (hard negatives).
    ``split``: ``TRAIN``/``TRIAL``/``TEST`` or ``None`` for all 9,840."""
    import datasets

    ds = datasets.load_dataset(
        "csv", data_files=str(Path(root) / "pairs/sick/SICK.txt"), delimiter="\t", split="train"
    )
    if split:
        ds = ds.filter(lambda r: r["SemEval_set"] == split)
    return ds.map(
        lambda r: {
            "sentence1": r["sentence_A"],
            "sentence2": r["sentence_B"],
            "label": int(
                r["entailment_AB"] == "A_entails_B" and r["entailment_BA"] == "B_entails_A"
            ),
            "contradiction": int(r["entailment_label"] == "CONTRADICTION"),
        }
    )


@dataclass
class MemoryTask:
    """A retrieval task: memories to store and questions to ask.

    Attributes:
        spec: the task's metadata.
        shas: sha256 of each file read.
        memories: dicts with ``id``, ``namespace``, ``text``, ``source_ids``, ``created_at``
            (hours since the epoch) and optionally ``importance``.
        questions: ``DataFrame`` with ``qid``, ``group``, ``question``, ``answer``,
            ``category`` (int), ``evidence`` (list of ids matched against ``source_ids``) and
            ``now_h`` (hours since the epoch when the question is asked).
        memory_group: maps a memory's namespace to the question ``group`` that may see it.
        category_names: ``{code: label}`` for reports.
    """

    spec: TaskSpec
    shas: dict[str, str]
    memories: list[dict[str, Any]]
    questions: Any
    memory_group: Any
    category_names: dict[int, str]


def locomo_task(
    path: str | Path,
    root: str | Path,
    allow_hash_mismatch: bool = False,
    conversations: int | None = None,
    importance: Any = None,
) -> MemoryTask:
    """LOCOMO observations and questions -> :class:`MemoryTask` (groups = conversations;
    categories labelled in both LOCOMO's and Mem0's conventions).

    Args:
        path: ``locomo10.json``.
        root: data dir for the hash check of the declared file.
        conversations: only the first N conversations.
        importance: :class:`~consolidate.config.ImportanceConfig` for the heuristic.
    """
    from ..config import ImportanceConfig
    from ..store.locomo import heuristic_importance, read_locomo_observations
    from .metrics import LOCOMO_CATEGORY, category_label

    spec = TASKS["locomo10"]
    if Path(path).resolve() == (Path(root) / "locomo/locomo10.json").resolve():
        shas = verify(spec, root, allow_hash_mismatch)
    else:
        got = sha256_file(path)
        if got != spec.files["locomo/locomo10.json"] and not allow_hash_mismatch:
            raise DatasetHashError(
                f"{path} has sha256 {got}, not LOCOMO's; pass allow_hash_mismatch=true to use it"
            )
        shas = {str(path): got}
    imp = importance or ImportanceConfig()
    obs, _ = read_locomo_observations(path, conversations)
    memories = [
        {
            "id": o.id,
            "namespace": o.namespace,
            "text": o.text,
            "source_ids": o.source_ids,
            "created_at": o.time_h,
            "importance": heuristic_importance(o.text, imp),
        }
        for o in obs
    ]
    qa = load_locomo_qa(path).to_pandas()
    convs = {o.conversation for o in obs}
    qa = qa[qa["conversation"].isin(convs)].reset_index(drop=True)
    qa["group"] = qa["conversation"]
    return MemoryTask(
        spec,
        shas,
        memories,
        qa,
        lambda ns: str(ns).split("/")[0],
        {c: category_label(c) for c in LOCOMO_CATEGORY},
    )


def _lme_time(s: str) -> float:
    from datetime import datetime, timezone

    d = datetime.strptime(s.split(" (")[0] + " " + s.split(") ")[-1], "%Y/%m/%d %H:%M")
    return d.replace(tzinfo=timezone.utc).timestamp() / 3600


def longmemeval_task(
    path: str | Path, spec: TaskSpec | None = None, allow_hash_mismatch: bool = False
) -> MemoryTask:
    """LongMemEval-format file -> :class:`MemoryTask`. Each question has its own haystack, so
    its namespace (and group) is its ``question_id``; every user turn becomes a memory with
    ``source_ids = [session_id, "<session_id>:<turn>"]``. Evidence: the turns flagged
    ``has_answer``, or else the ``answer_session_ids``.

    Raises:
        DatasetHashError: the file's hash differs from ``spec`` (unless allowed).
        ValueError: a row has unequal session/date/id lists (names the question).
    """
    path = Path(path)
    got = sha256_file(path)
    if spec is not None:
        want = next(iter(spec.files.values()))
        if want and got != want and not allow_hash_mismatch:
            raise DatasetHashError(f"{path} has sha256 {got}, expected {want}")
    ds = load_longmemeval(path)
    types = sorted(set(ds["question_type"]))
    code = {t: k + 1 for k, t in enumerate(types)}
    memories, questions = [], []
    for row in ds:
        qid = row["question_id"]
        sess, dates, ids = (
            row["haystack_sessions"],
            row["haystack_dates"],
            row["haystack_session_ids"],
        )
        if not len(sess) == len(dates) == len(ids):
            raise ValueError(
                f"{path}: question {qid!r} has {len(sess)} sessions, "
                f"{len(dates)} dates and {len(ids)} session ids"
            )
        evidence = []
        for sid, date, turns in zip(ids, dates, sess, strict=True):
            t_h = _lme_time(date)
            for k, turn in enumerate(turns):
                if turn.get("has_answer"):
                    evidence.append(f"{sid}:{k}")
                if turn["role"] != "user":
                    continue
                memories.append(
                    {
                        "id": f"{qid}/{sid}/t{k}",
                        "namespace": qid,
                        "text": turn["content"],
                        "source_ids": [sid, f"{sid}:{k}"],
                        "created_at": t_h,
                    }
                )
        questions.append(
            {
                "qid": qid,
                "group": qid,
                "question": row["question"],
                "answer": str(row["answer"]),
                "category": code[row["question_type"]],
                "evidence": evidence or list(row["answer_session_ids"]),
                "now_h": _lme_time(row["question_date"]),
            }
        )
    import pandas as pd

    spec = spec or TaskSpec(
        "longmemeval",
        "1.0",
        {str(path): ""},
        main_score=TASKS["longmemeval-fixture"].main_score,
        source=f"a file in LongMemEval's format: {path}",
    )
    return MemoryTask(
        spec,
        {str(path): got},
        memories,
        pd.DataFrame(questions),
        lambda ns: ns,
        {v: k for k, v in code.items()},
    )


def load_longmemeval(path: str | Path) -> Any:
    """A LongMemEval-format file (Wu et al., 2024, "LongMemEval: Benchmarking Chat Assistants
    on Long-Term Interactive Memory") as a ``datasets.Dataset``: one row per question with
    ``question_id``, ``question_type``, ``question``, ``answer``, ``question_date``,
    ``haystack_session_ids``, ``haystack_dates``, ``haystack_sessions`` (lists of
    ``{role, content, has_answer}`` turns) and ``answer_session_ids``."""
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train")
