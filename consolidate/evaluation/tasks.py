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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TaskSpec", "DatasetHashError", "TASKS", "verify", "load_locomo_qa",
           "load_stsb", "load_sick", "load_longmemeval", "sha256_file"]


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
        "locomo10", "1.0",
        {"locomo/locomo10.json":
         "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"},
        {"conversations": 10, "observations": 2541, "qa": 1986},
        "evidence_recall@10",
        "Maharana et al., ACL 2024; CC BY-NC 4.0",
    ),
    "stsb": TaskSpec(
        "stsb", "1.0",
        {"pairs/stsb/sts-train.csv":
         "0f71910b59aa1ad973c5897f0791f3b0965a92b8f82b1a95f3eea9f4162fda82",
         "pairs/stsb/sts-dev.csv":
         "5d7e944d8b02734b07bfdb5df67db3420c64bed153fcaa1ba47ad03480cf4234",
         "pairs/stsb/sts-test.csv":
         "affe45928a66ee5a708531233c95b7dacbbdc57f974f002a3d32ea0180cf816a"},
        {"train": 5749, "dev": 1500, "test": 1379},
        "average_precision",
        "STS Benchmark (Cer et al., 2017); scores CC BY-SA 4.0; duplicate = score >= 4",
    ),
    "sick": TaskSpec(
        "sick", "1.0",
        {"pairs/sick/SICK.txt":
         "1539c2d059809b5bd40694e26d8121cc85b6b496f91c7b40f2fc83bbd7dcd957"},
        {"pairs": 9840, "mutual_entailment": 1300, "contradiction": 1424},
        "average_precision",
        "Marelli et al., LREC 2014; CC BY-NC-SA 3.0; duplicate = mutual entailment",
    ),
}


class DatasetHashError(ValueError):
    """A data file's sha256 differs from the task's declared one."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(spec: TaskSpec, root: str | Path, allow_hash_mismatch: bool = False
           ) -> dict[str, str]:
    """Check every file of ``spec`` under ``root``; return ``{relative path: sha256 read}``.

    Raises:
        FileNotFoundError: a file is missing (names it and the data dir setting).
        DatasetHashError: a hash differs and ``allow_hash_mismatch`` is false.
    """
    out = {}
    for rel, want in spec.files.items():
        p = Path(root) / rel
        if not p.exists():
            raise FileNotFoundError(f"{spec.name}: {p} not found (set paths.data_dir or "
                                    f"CONSOLIDATE_DATA_DIR)")
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
            rows.append({
                "conversation": sid, "qid": f"{sid}/q{k}", "question": str(q["question"]),
                "answer": "" if q.get("answer") is None else str(q["answer"]),
                "adversarial_answer": str(q.get("adversarial_answer") or ""),
                "category": int(q["category"]), "evidence": good,
                "evidence_malformed": bad, "now_h": float(now_h),
            })
    return datasets.Dataset.from_list(rows)


_STSB_COLS = ["genre", "file", "years", "id", "score", "sentence1", "sentence2", "src1", "src2"]


def load_stsb(root: str | Path, split: str = "dev") -> Any:
    """STS-B split (``train``/``dev``/``test``) with ``sentence1``, ``sentence2``, ``score``
    (0-5) and ``label`` (1 when score >= 4). Tab-separated, no quoting, some rows carry two
    extra source columns."""
    import datasets

    ds = datasets.load_dataset(
        "csv", data_files={split: str(Path(root) / f"pairs/stsb/sts-{split}.csv")},
        delimiter="\t", quoting=3, header=None, names=_STSB_COLS, split=split,
    )
    return ds.map(lambda r: {"label": int(float(r["score"]) >= 4.0)})


def load_sick(root: str | Path, split: str | None = None) -> Any:
    """SICK pairs with ``label`` = 1 for mutual entailment (A entails B and B entails A) and
    ``contradiction`` = 1 when the pair's entailment label is CONTRADICTION (hard negatives).
    ``split``: ``TRAIN``/``TRIAL``/``TEST`` or ``None`` for all 9,840."""
    import datasets

    ds = datasets.load_dataset("csv", data_files=str(Path(root) / "pairs/sick/SICK.txt"),
                               delimiter="\t", split="train")
    if split:
        ds = ds.filter(lambda r: r["SemEval_set"] == split)
    return ds.map(lambda r: {
        "sentence1": r["sentence_A"], "sentence2": r["sentence_B"],
        "label": int(r["entailment_AB"] == "A_entails_B" and r["entailment_BA"] == "B_entails_A"),
        "contradiction": int(r["entailment_label"] == "CONTRADICTION"),
    })


def load_longmemeval(path: str | Path) -> Any:
    """A LongMemEval-format file (Wu et al., 2024, "LongMemEval: Benchmarking Chat Assistants
    on Long-Term Interactive Memory") as a ``datasets.Dataset``: one row per question with
    ``question_id``, ``question_type``, ``question``, ``answer``, ``question_date``,
    ``haystack_session_ids``, ``haystack_dates``, ``haystack_sessions`` (lists of
    ``{role, content, has_answer}`` turns) and ``answer_session_ids``."""
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train")
