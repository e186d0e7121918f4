"""LOCOMO importer: each extracted observation becomes one memory.

Source: Maharana et al., ACL 2024, "Evaluating Very Long-Term Conversational Memory of LLM
Agents" (``locomo10.json``, CC BY-NC 4.0; 10 conversations, 2,541 observations). Used in place
from ``paths.data_dir``; never copied into this repository.

The file is read with the standard ``json`` module rather than HF ``datasets``: observation
evidence is sometimes a string and sometimes a list, and session keys differ per conversation,
which Arrow's schema inference rejects.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import ImportanceConfig
from ..text import _date_terms, _numbers, content_tokens
from .schema import Records, records_from_rows

__all__ = [
    "LocomoObservation",
    "ImportReport",
    "read_locomo_observations",
    "heuristic_importance",
    "parse_session_time",
    "parse_evidence",
    "locomo_records",
]

_EVID = re.compile(r"^D\d+:\d+$")
_SESSION_OBS = re.compile(r"^session_(\d+)_observation$")
LOCOMO_SHA256 = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"


@dataclass
class LocomoObservation:
    """One LOCOMO observation as a memory: its id, namespace (the speaker's conversation),
    text, the dialogue ids it came from, its session's time (hours since the epoch),
    conversation, speaker and session number."""

    id: str
    namespace: str
    text: str
    source_ids: list[str]
    time_h: float
    conversation: str
    speaker: str
    session: int


@dataclass
class ImportReport:
    """What the importer could not parse cleanly (each entry names the record)."""

    file: str
    sha256: str
    observations: int = 0
    conversations: int = 0
    malformed_evidence: list[dict[str, Any]] = field(default_factory=list)
    bad_times: list[dict[str, Any]] = field(default_factory=list)
    #: observations that are not ``[text, evidence]`` with a non-empty text (not imported)
    malformed_items: list[dict[str, Any]] = field(default_factory=list)


def parse_session_time(s: str) -> datetime:
    """Parse LOCOMO session times such as ``"1:56 pm on 8 May, 2023"`` (UTC).

    Raises:
        ValueError: no known format matches.
    """
    s = " ".join(s.replace(",", ", ").split()).replace(" ,", ",")
    for fmt in (
        "%I:%M %p on %d %B, %Y",
        "%I:%M %p on %d %b, %Y",
        "%I:%M %p on %B %d, %Y",
        "%I:%M%p on %d %B, %Y",
    ):
        try:
            return datetime.strptime(s, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
    raise ValueError(f"unrecognised LOCOMO date/time {s!r}")


def parse_evidence(e: Any) -> tuple[list[str], list[str]]:
    """Split LOCOMO evidence (``"D1:3"``, a list, or ids joined by ``,``/``;``/spaces).

    Returns:
        ``(valid dia_ids, malformed tokens)``.
    """
    items = e if isinstance(e, list) else [e]
    good: list[str] = []
    bad: list[str] = []
    for it in items:
        for tok in re.split(r"[,;\s]+", str(it).strip()):
            if not tok:
                continue
            (good if _EVID.match(tok) else bad).append(tok)
    return good, bad


def heuristic_importance(text: str, cfg: ImportanceConfig) -> float:
    """Importance in [0, 1] from surface cues (LOCOMO has no importance labels).

    ``base`` + ``number_bonus`` if the text states a number + ``date_bonus`` if it states a
    date term + ``keyword_bonus`` if it contains one of ``cfg.keywords`` (life events,
    preferences, plans) + ``length_bonus`` if it is longer than ``long_text_chars``; clipped
    to [0, 1]. A stand-in for the write-time LLM rating of the write path.
    """
    toks = content_tokens(text)
    low = " " + " ".join(toks) + " "
    score = cfg.base
    if _numbers(toks, text):
        score += cfg.number_bonus
    if _date_terms(toks):
        score += cfg.date_bonus
    if any(f" {k} " in low for k in cfg.keywords):
        score += cfg.keyword_bonus
    if len(text) > cfg.long_text_chars:
        score += cfg.length_bonus
    return float(min(1.0, max(0.0, score)))


def read_locomo_observations(
    path: str | Path, conversations: int | None = None
) -> tuple[list[LocomoObservation], ImportReport]:
    """Read every observation of ``locomo10.json``.

    Namespace = ``<sample_id>/<speaker>``; id = ``<sample_id>/<speaker>/s<session>/<k>``;
    source_ids = the evidence dia_ids; time = the session's date and time (UTC, hours since
    the epoch). Evidence that cannot be parsed is reported and kept verbatim as a source id;
    a session time that cannot be parsed is reported and the nearest parseable session's
    time is used. An item that is not ``[text, evidence]`` with a non-empty text cannot
    become a memory: it is listed in ``malformed_items`` (with its would-be id), never
    dropped silently.

    Args:
        path: ``locomo10.json``.
        conversations: only the first N conversations (``None`` = all).

    Raises:
        FileNotFoundError: ``path`` does not exist (message suggests ``paths.data_dir`` and
            ``CONSOLIDATE_DATA_DIR``).
        ValueError: the file is not valid JSON or not LOCOMO-shaped (names the file and the
            conversation), or a conversation has no parseable session time.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"LOCOMO file not found: {path}. Set paths.data_dir=... or the environment "
            f"variable CONSOLIDATE_DATA_DIR to the folder that holds locomo/locomo10.json"
        )
    raw = path.read_bytes()
    report = ImportReport(str(path), hashlib.sha256(raw).hexdigest())
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    out: list[LocomoObservation] = []
    for ci, conv in enumerate(data[:conversations]):
        sid = conv.get("sample_id") if isinstance(conv, dict) else None
        where = f"{path}: conversation #{ci} ({sid!r})"
        if (
            not isinstance(sid, str)
            or not isinstance(conv.get("observation"), dict)
            or not isinstance(conv.get("conversation"), dict)
        ):
            raise ValueError(
                f"{where}: needs a string sample_id and dicts 'conversation' and 'observation'"
            )
        report.conversations += 1
        out += _conversation_observations(conv, sid, where, report)
    report.observations = len(out)
    return out, report


def _conversation_observations(
    conv: dict[str, Any], sid: str, where: str, report: ImportReport
) -> list[LocomoObservation]:
    """The observations of one conversation (see :func:`read_locomo_observations`); bad
    session times, malformed items and malformed evidence go to ``report``.

    Raises:
        ValueError: no session time parses, or the observations are not shaped as LOCOMO's.
    """
    sessions = sorted(
        (int(m.group(1)), k) for k in conv["observation"] if (m := _SESSION_OBS.match(k))
    )
    times: dict[int, float] = {}
    for num, _ in sessions:
        when = conv["conversation"].get(f"session_{num}_date_time")
        try:
            times[num] = parse_session_time(when).timestamp() / 3600.0
        except (ValueError, AttributeError, TypeError):
            report.bad_times.append({"conversation": sid, "session": num, "value": when})
    if sessions and not times:
        raise ValueError(f"{where}: no session has a parseable date/time")
    out: list[LocomoObservation] = []
    for num, key in sessions:
        # an unparseable session time takes the nearest parseable session's time
        t_h = times.get(num)
        if t_h is None:
            t_h = times[min(times, key=lambda s: (abs(s - num), s))]
        by_speaker = conv["observation"][key]
        if not isinstance(by_speaker, dict):
            raise ValueError(f"{where}: {key} is not a dict of speaker -> observations")
        for speaker, items in by_speaker.items():
            if not isinstance(items, list):
                raise ValueError(f"{where}: {key}/{speaker} is not a list of observations")
            for k, item in enumerate(items):
                rid = f"{sid}/{speaker}/s{num}/{k}"
                ok = (
                    isinstance(item, list)
                    and 1 <= len(item) <= 2
                    and isinstance(item[0], str)
                    and item[0].strip()
                )
                if not ok:
                    report.malformed_items.append({"id": rid, "item": repr(item)[:200]})
                    continue
                text, evid = (item + [None])[:2]
                good, bad = parse_evidence(evid) if evid is not None else ([], [])
                if bad or not good:
                    report.malformed_evidence.append({"id": rid, "evidence": evid})
                out.append(
                    LocomoObservation(
                        rid, f"{sid}/{speaker}", text, good + bad, t_h, sid, str(speaker), num
                    )
                )
    return out


def locomo_records(
    path: str | Path,
    embedder: Any,
    importance: ImportanceConfig | None = None,
    conversations: int | None = None,
) -> tuple[Records, ImportReport]:
    """Observations -> embedded :class:`Records` (created_at = last_used = session time).

    Args:
        path: ``locomo10.json``.
        embedder: object with ``encode(texts) -> float32 [n, d]`` and ``dim``.
        importance: heuristic settings (default :class:`ImportanceConfig`).
        conversations: only the first N conversations.
    """
    importance = importance or ImportanceConfig()
    obs, report = read_locomo_observations(path, conversations)
    vecs = embedder.encode([o.text for o in obs])
    rows = [
        {
            "id": o.id,
            "namespace": o.namespace,
            "text": o.text,
            "vector": vecs[k],
            "importance": heuristic_importance(o.text, importance),
            "created_at": o.time_h,
            "last_used": o.time_h,
            "source_ids": o.source_ids,
        }
        for k, o in enumerate(obs)
    ]
    return records_from_rows(rows, dim=int(vecs.shape[1]) if len(obs) else embedder.dim), report


def read_locomo_turns(
    path: str | Path,
    conversations: int | None = None,
    sessions: int | None = None,
    max_turns: int | None = None,
) -> list[Any]:
    """LOCOMO dialogue turns as :class:`~consolidate.llm.extract.Turn` (id = dia_id prefixed
    by the conversation, namespace = ``<sample_id>/<speaker>``, time = the session's time).

    Args:
        path: ``locomo10.json``.
        conversations, sessions: only the first N of each.
        max_turns: stop after this many turns in all.

    Raises:
        ValueError: a session's date/time cannot be parsed (names the conversation).
    """
    from ..turns import Turn

    data = json.loads(Path(path).read_bytes())
    out: list[Turn] = []
    for conv in data[:conversations]:
        sid, c = conv["sample_id"], conv["conversation"]
        nums = sorted(int(m.group(1)) for k in c if (m := re.match(r"^session_(\d+)$", k)))
        for num in nums[:sessions]:
            try:
                t_h = parse_session_time(c[f"session_{num}_date_time"]).timestamp() / 3600
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}: {sid} session {num}: {e}") from e
            for turn in c[f"session_{num}"]:
                out.append(
                    Turn(
                        f"{sid}/{turn['dia_id']}",
                        f"{sid}/{turn['speaker']}",
                        turn["speaker"],
                        str(turn.get("text", "")),
                        t_h,
                        source="user",
                    )
                )  # both LOCOMO speakers are people
                if max_turns is not None and len(out) >= max_turns:
                    return out
    return out
