"""Memories from plain files: JSONL, Parquet and CSV, in the schema ``consolidate-export``
writes (so an export imports back unchanged) or in a smaller one a user writes by hand.

Schema (one memory a line in JSONL, a row in Parquet and CSV; default when absent after
the colon):

- ``text``: the memory (required);
- ``id``: a unique string: generated (below);
- ``namespace``: the user or agent it belongs to: the ``namespace`` argument;
- ``vector``: the embedding, a list of numbers (CSV: a JSON array): every row embedded;
- ``importance``: 0..1, rated at write time: 0.5;
- ``strength``: >= 1 (+1 per recall or merge): 1;
- ``created_at``, ``last_used``: ISO 8601 (naive = UTC) or hours since the Unix epoch:
  each other, else now;
- ``pinned``: a boolean (CSV: true/false/1/0): false;
- ``source_ids``: provenance, a list of strings (CSV: a JSON array): none;
- ``valid_from``, ``valid_to``: the validity interval, times as above: open;
- ``deleted_at``, ``deleted_reason``, ``merged_into``: a tombstone (a merged or dropped
  memory): live.

``last_pass``, ``keep_apart``, ``derived_from`` and ``text_hash`` round-trip an export;
other columns are ignored and listed in the report. Either every row has a vector (all of
one length), or the rows without one are embedded with the given embedder (all of them
in a file without vectors; in a file with vectors, the lines an agent appended with text
only, by the model that made the others: its width is checked).

A generated id is ``"imp-"`` and 20 hex digits of SHA-256 over the namespace, the text and
the number of earlier rows with the same two, so importing the same file twice is refused
as duplicate ids rather than stored twice.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..store.schema import COLUMNS, Records, records_from_arrow, records_from_rows
from .common import ApplyReport, Plan, UndoReport, as_stored, undo_by_journal, with_keep_apart

__all__ = [
    "FILE_SUFFIXES",
    "FileImport",
    "read_memories",
    "FileSource",
    "FileSnapshot",
    "FilePlan",
    "FileApplyReport",
    "append_memories",
]

#: file suffixes :func:`read_memories` reads
FILE_SUFFIXES = (".jsonl", ".parquet", ".csv")

_KNOWN = set(COLUMNS) | {"vector"}
_LISTS = ("source_ids", "keep_apart", "derived_from")
_NUMBERS = (
    "importance",
    "strength",
    "last_pass",
    "created_at",
    "last_used",
    "valid_from",
    "valid_to",
    "deleted_at",
)


@dataclass
class FileImport:
    """What :func:`read_memories` read.

    Attributes:
        records: the memories (vectors ``float32 [n, d]``, as given or embedded).
        path: the file.
        generated_ids: rows that had no ``id``.
        embedded: whether the texts were embedded (no row had a vector).
        ignored_columns: columns outside the schema.
        extra: their values, indexed by record id (``None`` when there are none).
    """

    records: Records
    path: str
    generated_ids: int = 0
    embedded: bool = False
    ignored_columns: list[str] = field(default_factory=list)
    extra: Any = None


def _where(path: Path, row: int, lines: list[int] | None) -> str:
    """Where record ``row`` is: its line (``lines[row]``), or its row of a Parquet file."""
    return f"{path} row {row}" if lines is None else f"{path} line {lines[row]}"


def _stored_vectors(table: Any, path: Path) -> np.ndarray | None:
    """The ``vector`` column of a Parquet file decoded when it holds a store's encoding
    (fp16, bf16 bits, int8 with ``vector_scale``), else ``None`` (numbers, read as given).

    Raises:
        ValueError: an encoding that cannot be decoded (int8 without its scale column)."""
    import pyarrow as pa

    from ..store.vectors import decode_vectors

    if "vector" not in table.column_names:
        return None
    t = table.schema.field("vector").type
    if (
        not pa.types.is_fixed_size_list(t)
        or pa.types.is_floating(t.value_type)
        and not pa.types.is_float16(t.value_type)
    ):
        return None
    try:
        return decode_vectors(
            table.column("vector"),
            table.column("vector_scale") if "vector_scale" in table.column_names else None,
        )
    except ValueError as e:
        raise ValueError(f"{path}: the vector column cannot be decoded ({e})") from None


def _check_utf8(table: Any, path: Path) -> None:
    """Every string cell of a Parquet table is valid UTF-8 (Arrow trusts what the file's
    writer declared).

    Raises:
        ValueError: names the file, the column and the first row with invalid bytes."""
    import pyarrow as pa

    for name in table.column_names:
        col = table.column(name)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            continue
        try:
            col.validate(full=True)
        except pa.ArrowInvalid:
            raw = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())
            for k, b in enumerate(raw.to_pylist()):  # only on the error path
                try:
                    if b is not None:
                        b.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{path} row {k}: column {name!r} is not valid UTF-8 "
                        f"(byte {e.start + 1}: {e.reason})"
                    ) from None
            raise ValueError(f"{path}: column {name!r} is not valid UTF-8") from None


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    for k, line in enumerate(_lines(path)):
        if not line.strip():
            raise ValueError(
                f"{path} line {k + 1}: an empty line (one JSON object a line, none empty)"
            )
        try:
            row = json.loads(line, parse_int=_int)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {k + 1}: not JSON ({e.msg})") from None
        except (RecursionError, ValueError) as e:
            raise ValueError(f"{path} line {k + 1}: {str(e).splitlines()[0]}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {k + 1}: a JSON {type(row).__name__}, not an object")
        yield row


def _lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file, each with its line ending (a byte-order mark at the
    start is skipped). Each line is decoded by itself, so a bad byte is named by its line.

    Raises:
        ValueError: a byte sequence that is not UTF-8 (names the file, line and column)."""
    with path.open("rb") as f:
        for k, raw in enumerate(f):
            if k == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} line {k + 1}: not UTF-8 at byte {e.start + 1} of the line ({e.reason})"
                ) from None


def _int(s: str) -> int | float:
    """A JSON integer; one too long for a float64 is refused (it is no vector value,
    importance or time)."""
    if len(s.lstrip("-")) > 300:
        raise ValueError(f"a number of {len(s)} digits")
    return int(s)


def _csv_value(c: str, v: str, where: str) -> Any:
    """One CSV cell as the schema's type (``""`` is absent)."""
    if v == "":
        return None
    if c == "vector" or c in _LISTS:
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: {c} is not a JSON array: {v[:40]!r}") from None
    if c == "pinned":
        low = v.strip().lower()
        if low in ("true", "1"):
            return True
        if low in ("false", "0"):
            return False
        raise ValueError(f"{where}: pinned is not true/false/1/0: {v[:40]!r}")
    if c in _NUMBERS:
        try:
            return float(v)
        except ValueError:
            if c in ("importance", "strength", "last_pass"):
                raise ValueError(f"{where}: {c} is not a number: {v[:40]!r}") from None
            return v  # a time as ISO 8601
    return v


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line, record)`` for each record of a CSV file with a header row (RFC 4180:
    ``,`` separated, ``"`` quoted, a quote inside a quoted cell doubled, line breaks only
    inside quoted cells).

    Raises:
        ValueError: no header, a header with an empty or repeated name, a record with more
            or fewer cells than the header, a malformed quote, or a cell of the wrong type;
            each names the file and the line the record starts on."""
    lines = _lines(path)
    read = [0]  # lines the reader has taken so far

    def counted() -> Iterator[str]:
        for k, line in enumerate(lines):
            read[0] = k + 1
            yield line

    reader = csv.reader(counted(), dialect="excel", strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{path}: empty (a CSV file with a header row)") from None
    except csv.Error as e:
        raise ValueError(f"{path} line 1: not CSV ({e})") from None
    names = [h.strip() for h in header]
    if not names or any(not h for h in names) or len(set(names)) != len(names):
        raise ValueError(
            f"{path} line 1: the header {header[:12]!r} has an empty or repeated column name"
        )
    while True:
        first = read[0] + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise ValueError(f"{path} line {first}: not CSV ({e})") from None
        where = f"{path} line {first}"
        if not cells:
            raise ValueError(f"{where}: an empty line (one record a line, none empty)")
        if len(cells) != len(names):
            raise ValueError(
                f"{where}: {len(cells)} cells, the header has {len(names)} "
                f"({', '.join(names)}); a cell holding a comma must be quoted"
            )
        yield first, {c: _csv_value(c, v, where) for c, v in zip(names, cells, strict=True)}


def _generated_ids(rows: list[dict[str, Any]], namespace: str) -> int:
    """Give rows without an ``id`` a content id (see the module docstring); returns how many."""
    seen: Counter[tuple[str, str]] = Counter()
    n = 0
    for r in rows:
        if r.get("id") is not None:
            continue
        key = (str(r.get("namespace")), str(r.get("text")))
        h = hashlib.sha256(f"{key[0]}\0{key[1]}\0{seen[key]}".encode()).hexdigest()
        seen[key] += 1
        r["id"] = f"imp-{h[:20]}"
        n += 1
    return n


def read_memories(
    path: str | Path,
    *,
    namespace: str = "default",
    embedder: Any = None,
    now_h: float | None = None,
    known_ids: Any = (),
) -> FileImport:
    """Read the memories in a JSONL, Parquet or CSV file (schema: the module docstring).

    Args:
        path: the file (``.jsonl``, ``.parquet`` or ``.csv``).
        namespace: for rows without one.
        embedder: an :class:`~consolidate.embed.Embedder` (anything with ``encode(texts) ->
            float32 [n, d]``) for a file without vectors; ``None`` then is an error.
        now_h: the clock for the checks of times in the future (hours since the epoch;
            default now).
        known_ids: ids of another file that a ``merged_into`` may name (a tombstone
            sidecar's merged records live in the memory file).

    Returns:
        :class:`FileImport`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: another suffix, a line that is not a JSON object, a cell of the wrong
            type, some rows with vectors and some without, no vectors and no embedder, or
            an empty file; each names the file and the line.
        InvalidRecordsError: records that break the store's rules (an importance outside
            0..1, a time in the future, a duplicate id, ...), named by id and line.
    """
    p = Path(path)
    if p.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{p}: a memory file must end in {', '.join(FILE_SUFFIXES)}")
    if not p.is_file():
        raise FileNotFoundError(f"memory file not found: {p}")
    got = _file_rows(p, now_h, known_ids)
    if isinstance(got, FileImport):
        return got
    rows, lines = got
    if not rows:
        raise ValueError(f"{p}: no memories in the file")
    ignored = sorted({c for r in rows for c in r} - _KNOWN)
    _check_rows(rows, lines, p, namespace)
    generated = _generated_ids(rows, namespace)
    embedded = _vectors_or_embed(rows, lines, p, embedder)
    recs = as_stored(
        records_from_rows(rows),
        str(p),
        now_h=now_h,
        first_line=0,
        lines=lines,
        unit="row" if p.suffix == ".parquet" else "line",
        known_ids=known_ids,
    )
    extra = None
    if ignored:
        import pandas as pd

        extra = pd.DataFrame(
            [{c: r.get(c) for c in ignored} for r in rows],
            index=[r["id"] for r in rows],
            columns=ignored,
        )
    return FileImport(
        recs,
        str(p),
        generated_ids=generated,
        embedded=embedded,
        ignored_columns=ignored,
        extra=extra,
    )


def _file_rows(
    p: Path, now_h: float | None, known_ids: Any
) -> FileImport | tuple[list[dict[str, Any]], list[int] | None]:
    """The rows of memory file ``p`` as dicts and each one's line (``None``: rows of a
    Parquet file); a Parquet export of a store (its own schema) is read whole, as the
    :class:`FileImport` itself."""
    import pyarrow.parquet as pq

    if p.suffix == ".jsonl":
        rows = list(_jsonl_rows(p))
        return rows, list(range(1, len(rows) + 1))
    if p.suffix == ".csv":
        pairs = list(_csv_rows(p))
        return [r for _, r in pairs], [k for k, _ in pairs]
    table = pq.read_table(p)
    _check_utf8(table, p)
    if set(COLUMNS) <= set(table.column_names) and "vector" in table.column_names:
        # an export of a store: its own schema, vectors decoded from the stored dtype
        recs = as_stored(
            records_from_arrow(table),
            str(p),
            now_h=now_h,
            first_line=0,
            unit="row",
            known_ids=known_ids,
        )
        ignored = sorted(set(table.column_names) - _KNOWN - {"vector_scale"})
        extra = (
            table.select(ignored).to_pandas().set_axis(recs.meta["id"].to_numpy())
            if ignored
            else None
        )
        return FileImport(recs, str(p), ignored_columns=ignored, extra=extra)
    decoded = _stored_vectors(table, p)
    rows = table.drop_columns(
        [c for c in ("vector", "vector_scale") if decoded is not None and c in table.column_names]
    ).to_pylist()
    if decoded is not None:
        for r, v in zip(rows, decoded, strict=True):
            r["vector"] = v
    return rows, None


def _check_rows(
    rows: list[dict[str, Any]], lines: list[int] | None, p: Path, namespace: str
) -> None:
    """Check each row's text and vector cell (naming its line) and give rows without a
    namespace ``namespace``; a NaN vector cell (pandas' empty cell) becomes no vector.

    Raises:
        ValueError: no text, a text that is not a string or not encodable as UTF-8, an
            empty vector.
    """
    for k, r in enumerate(rows):
        if not isinstance(r.get("text"), str):
            raise ValueError(
                f"{_where(p, k, lines)}: "
                f"{'no text' if r.get('text') is None else 'text is not a string'}"
            )
        try:
            r["text"].encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{_where(p, k, lines)}: the text holds a lone surrogate (not encodable as UTF-8)"
            ) from None
        v = r.get("vector")
        if isinstance(v, (list, tuple)) and not len(v):
            raise ValueError(f"{_where(p, k, lines)}: an empty vector")
        if r.get("namespace") is None:
            r["namespace"] = namespace
        if isinstance(r.get("vector"), float) and math.isnan(r["vector"]):
            r["vector"] = None


def _vectors_or_embed(
    rows: list[dict[str, Any]], lines: list[int] | None, p: Path, embedder: Any
) -> bool:
    """Every row's vector: as given, or embedded by ``embedder`` for the rows without one
    (all of them, or the lines an agent appended with text only to a file whose other rows
    carry vectors: the embedder must be the model that made those, and its width is
    checked); returns whether any text was embedded.

    Raises:
        ValueError: rows without a vector and no embedder; an embedder whose width is not
            the other rows' (named by record id and line); an embedder's input error
            named by record id and line.
    """
    has = np.array([r.get("vector") is not None for r in rows])
    if has.all():
        return False
    todo = np.flatnonzero(~has)
    if embedder is None:
        if has.any():
            raise ValueError(
                f"{_where(p, int(todo[0]), lines)}: no vector, while {int(has.sum())} other "
                f"rows have one; give an embedder (the model that embedded the others) to "
                f"embed the rows without one"
            )
        raise ValueError(f"{p}: no row has a vector; give an embedder to embed the texts")
    from ..embed import EmbedInputError, name_embed_error

    try:
        vecs = np.asarray(embedder.encode([rows[k]["text"] for k in todo]), dtype=np.float32)
    except EmbedInputError as e:
        raise name_embed_error(
            e, [f"{rows[k]['id']!r} ({_where(p, int(k), lines)})" for k in todo]
        ) from None
    if has.any():
        k0 = int(np.flatnonzero(has)[0])
        width = len(rows[k0]["vector"])
        if vecs.shape[1] != width:
            k = int(todo[0])
            raise ValueError(
                f"{_where(p, k, lines)}: no vector, and the embedder gives {vecs.shape[1]} "
                f"dimensions where the file's vectors have {width} (row "
                f"{rows[k0]['id']!r}): embed with the model that made them"
            )
    for k, v in zip(todo, vecs, strict=True):
        rows[int(k)]["vector"] = v
    return True


@dataclass
class FileSnapshot:
    """What :meth:`FileSource.read` read.

    Attributes:
        records: every memory of the file (tombstones included).
        sha256: the file's content hash as read (the apply's check that it is unchanged).
        size: the file's length in bytes as read (lines appended after it are carried).
        scope: the rows of ``records`` in the namespaces asked for (the pass's input).
        extra: the file's columns outside the schema, by record id (``None``: none).
    """

    records: Records
    sha256: str
    scope: np.ndarray
    extra: Any = None
    size: int | None = None
    late: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FilePlan(Plan):
    """A :class:`~consolidate.sources.common.Plan` of a memory file (units: one per merge
    and per drop, for the report), with the file's new content.

    Attributes:
        content: every record the file will hold (the pass's result and the rows of other
            namespaces).
        sha256: the file's hash as read.
        size: the file's length as read.
        extra: the file's columns outside the schema, by record id (kept; a merged record
            gets its oldest member's).
    """

    content: Records | None = None
    sha256: str = ""
    extra: Any = None
    size: int | None = None
    late: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FileApplyReport(ApplyReport):
    """An :class:`~consolidate.sources.common.ApplyReport` of a memory file.

    Attributes:
        written: the file written (the result file in a dry run, else the source file).
        backup: the copy of the file as it was (``None`` in a dry run).
        carried: JSONL lines an agent appended after the read, carried into the file
            written (after the result's rows).
    """

    written: str = ""
    backup: str | None = None
    carried: int = 0


class FileSource:
    """A memory file (JSONL, Parquet or CSV in the schema above) as the pass's source and
    sink: ``consolidate source=jsonl source.path=memories.jsonl``.

    The pass reads the file (embedding the texts when it has no vectors), and the apply
    writes the whole result back in the same format: merged and dropped memories stay in
    it as tombstones (``deleted_at``, ``deleted_reason``, ``merged_into``), so nothing is
    lost and a merge can be undone by hand. A dry run writes the result to another file
    only. An apply first checks that the file is byte for byte as read (another writer
    since: nothing is written), copies it to ``<name>.pre-consolidate-<UTC time><suffix>``
    beside it (its permissions kept), writes the result beside it, checks the file once more
    and replaces it by rename (readers see the old file or the new one). Lines an agent
    appended to a JSONL file after the read are carried into the file written (a file
    changed any other way is not written: run the pass again); the check, the copy and the
    rename run under the journal folder's lock, which :func:`append_memories` takes too, so
    an agent appending through it never lands in the replaced file. Columns outside the schema are kept (a merged record takes
    its oldest member's). A symlink is followed: the file it names is replaced.

    With ``write="live"`` the file holds the live memories only, as a reader that knows
    nothing of tombstones expects, and the tombstones go to ``tombstones.parquet`` in the
    journal folder (written before the file; a row live in the file wins over the same id
    there). Every read joins the two, whichever ``write`` is set, so undo works in both
    modes and switching modes loses nothing; ``write="all"`` moves the sidecar's
    tombstones back into the file and removes it.

    Args:
        path: the file.
        namespace: for rows without one.
        embedder: for a file without vectors (see :func:`read_memories`).
        state_dir: the journal folder (default ``<path>.consolidate`` beside the file).
        write: ``all`` (live rows and tombstones in the file) or ``live``.

    Raises:
        ValueError: another ``write``.
    """

    KIND = "jsonl"

    def __init__(
        self,
        path: str | Path,
        namespace: str = "default",
        embedder: Any = None,
        state_dir: str | Path | None = None,
        write: str = "all",
    ) -> None:
        from .journal import Journal, default_state_dir

        if write not in ("all", "live"):
            raise ValueError(f"source.write must be all or live, got {write!r}")
        self.path = Path(path)
        self.namespace = namespace
        self.embedder = embedder
        self.write = write
        self.journal = Journal(state_dir or default_state_dir(self.path), f"file {self.path}")
        self.tombstones = self.journal.dir / "tombstones.parquet"

    def _read_all(self) -> FileImport:
        """The file's memories joined with the tombstone sidecar's (ids live in the file
        win; a sidecar's rows of ids the file holds as tombstones too are left out). The
        sidecar tombstones whose id the file holds live again (an agent appended a line
        with a retired id) are kept in ``self._revived`` (id, merged_into,
        deleted_reason) for :meth:`_settle_revived`."""
        self._revived = pd.DataFrame(columns=["id", "merged_into", "deleted_reason"])
        got = read_memories(self.path, namespace=self.namespace, embedder=self.embedder)
        if not self.tombstones.exists():
            return got
        side = read_memories(
            self.tombstones, namespace=self.namespace, known_ids=got.records.meta["id"]
        )
        extra_rows = side.records.meta["id"].isin(set(got.records.meta["id"])).to_numpy()
        more = side.records.mask(~extra_rows)
        sm = side.records.meta
        live_ids = set(got.records.meta["id"][got.records.live_mask()])
        hit = extra_rows & sm["id"].isin(live_ids).to_numpy()
        self._revived = sm.loc[hit, ["id", "merged_into", "deleted_reason"]].reset_index(drop=True)
        if not len(more):
            return got
        if more.dim != got.records.dim:
            raise ValueError(
                f"{self.tombstones}: vectors of dimension {more.dim}, the file's are "
                f"{got.records.dim}"
            )
        extra = got.extra
        if side.extra is not None or extra is not None:
            parts = [e for e in (extra, side.extra) if e is not None]
            extra = pd.concat(parts)
            extra = extra[~extra.index.duplicated(keep="first")]
        recs = Records.concat([got.records, more], got.records.dim)
        return replace(got, records=recs, extra=extra)

    def read(self, namespaces: Any = None) -> FileSnapshot:
        """Every memory of the file; the pass runs on those of ``namespaces`` (all when
        ``None``), the others are written back as they are.

        Raises:
            FileNotFoundError, ValueError, InvalidRecordsError: see :func:`read_memories`.
        """
        import contextlib
        import time

        # agents appending through append_memories wait while the file is read (their lock
        # folder exists once one has written); one appending otherwise: read again
        lock = self.journal.locked() if self.journal.dir.is_dir() else contextlib.nullcontext()
        with lock:
            for attempt in range(20):
                digest, size = _digest(self.path)
                got = self._read_all()
                if _sha256(self.path) == digest:
                    break
                time.sleep(0.01 * (attempt + 1))
            else:
                raise ValueError(
                    f"{self.path} kept changing while it was read (20 tries): run again"
                )
        recs, late = self._settle_revived(got.records)
        recs = with_keep_apart(recs, self.journal.keep_apart(), self.journal.kept())
        ns = recs.meta["namespace"]
        scope = (
            np.ones(len(ns), bool) if namespaces is None else ns.isin(list(namespaces)).to_numpy()
        )
        return FileSnapshot(recs, digest, scope, got.extra, size, late)

    def _settle_revived(self, recs: Records) -> tuple[Records, list[dict[str, Any]]]:
        """Late writes on a memory file: a line an agent appended with the id of a memory
        an apply retired makes it live again (the file's live row wins over the sidecar's
        tombstone). As on the other sources (:mod:`consolidate.sources.late`) its unit is
        undone, in the records the pass gets: the merged memory retired (``undone``), its
        other members live again, nothing kept apart; a revived drop is live already.
        Returns the records and the units (``LateWrite`` dicts, action ``undone``; the
        apply records them in the journal)."""
        from ..store.schema import hours_now
        from .late import LateWrite

        rv = getattr(self, "_revived", None)
        if rv is None or not len(rv):
            return recs, []
        meta = recs.meta.copy()
        ids = meta["id"].to_numpy(object)
        live = recs.live_mask()
        into = meta["merged_into"].to_numpy(object)
        reason = meta["deleted_reason"].to_numpy(object)
        key_of = {str(u["key"]): p["plan_id"] for p in self.journal.plans() for u in p["units"]}
        out: dict[str, LateWrite] = {}
        for i, m, why in rv.itertuples(index=False):
            key = m if isinstance(m, str) and why == "merged" else i
            lw = out.setdefault(
                key,
                LateWrite(key_of.get(key, ""), key, "merge" if key != i else "drop", []),
            )
            lw.rows.append(i)
        now = hours_now()
        for key, lw in out.items():
            lw.columns, lw.action = ["live"], "undone"
            if lw.kind == "drop":
                lw.why = "a dropped row was written"
                continue
            at = np.flatnonzero(ids == key)
            if not len(at) or not live[at[0]]:
                lw.action, lw.why = "left", f"the merged memory {key} is not live"
                continue
            back = np.flatnonzero((into == key) & (reason == "merged") & ~live)
            meta.loc[back, "deleted_at"] = np.nan
            meta.loc[back, "deleted_reason"] = None
            meta.loc[back, "merged_into"] = None
            meta.loc[at, "deleted_at"] = now
            meta.loc[at, "deleted_reason"] = "undone"
            lw.why = "a retired member's id was appended live"
        return Records(meta, recs.vectors, origin=recs.origin), [x.as_dict() for x in out.values()]

    def records(self, snap: FileSnapshot) -> Records:
        """The pass's input: the memories of the namespaces read."""
        return snap.records if snap.scope.all() else snap.records.mask(snap.scope)

    def plan(self, snap: FileSnapshot, result: Records) -> FilePlan:
        """The :class:`FilePlan` of the pass's ``result`` over ``snap``."""
        res = result.meta
        was_live = set(snap.records.meta["id"][snap.records.live_mask()])
        gone = res[res["deleted_at"].notna() & res["id"].isin(was_live)]
        units = []
        for into, g in gone[gone["deleted_reason"] == "merged"].groupby("merged_into"):
            units.append(
                {
                    "kind": "merge",
                    "namespace": g["namespace"].iloc[0],
                    "ids": sorted(g["id"]),
                    "into": into,
                    "key": into,
                }
            )
        drops = gone[gone["deleted_reason"] != "merged"]
        units += [
            {"kind": "drop", "namespace": ns, "ids": [i], "key": i}
            for i, ns in zip(drops["id"], drops["namespace"], strict=True)
        ]
        rest = snap.records.mask(~snap.scope) if not snap.scope.all() else None
        content = result if rest is None else Records.concat([result, rest], result.dim)
        extra = snap.extra
        if extra is not None and len(extra.columns) and units:
            # a merged record takes the file's other columns from its oldest member
            born = snap.records.meta.set_index("id")["created_at"]
            merges = [u for u in units if u["kind"] == "merge"]
            kept = [min(u["ids"], key=lambda i: (float(born[i]), i)) for u in merges]
            more = extra.reindex(kept)
            more.index = [u["into"] for u in merges]
            extra = pd.concat([extra, more[~more.index.isin(extra.index)]])
        blob = json.dumps(
            {"file": str(self.path.resolve()), "sha256": snap.sha256, "units": units},
            sort_keys=True,
            default=str,
        )
        return FilePlan(
            hashlib.sha256(blob.encode()).hexdigest()[:32],
            units,
            content=content,
            sha256=snap.sha256,
            extra=extra,
            size=snap.size,
            late=list(snap.late),
        )

    def apply(
        self, plan: FilePlan, *, dry_run: bool = True, out_dir: str | Path | None = None
    ) -> FileApplyReport:
        """Write the plan's content: in a dry run to ``<out_dir>/consolidated<suffix>``
        (without ``out_dir``: ``<file>.consolidated<suffix>`` beside the file), else over
        the file (after the copy).

        Raises:
            ValueError: the file changed since it was read (nothing written).
        """
        from ..store.lance import write_records_file

        assert plan.content is not None
        if dry_run:
            target = (
                Path(out_dir) / f"consolidated{self.path.suffix}"
                if out_dir is not None
                else self.path.with_name(f"{self.path.stem}.consolidated{self.path.suffix}")
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            write_records_file(plan.content, target, extra=plan.extra)
            rep = FileApplyReport(True, plan.counts(), written=str(target))
            rep.late = [
                x | {"action": "would undo"} if x["action"] == "undone" else x for x in plan.late
            ]
            return rep
        with self.journal.locked():  # a writer using append_memories waits
            self._recover()

            def pending(sha: str, n: int) -> None:  # just before the rename
                self.journal.begin(
                    {
                        "op": "apply",
                        "plan_id": plan.plan_id,
                        "units": plan.units,
                        "sha256": sha,
                        "size": n,
                    }
                )

            backup, carried = self._replace(
                plan.content, plan.extra, plan.sha256, plan.size, pending
            )
            self.journal.record_apply(plan.plan_id, plan.units)
            self.journal.done()
            self._record_late(plan.late)
        rep = FileApplyReport(
            False,
            plan.counts(),
            written=str(self.path.resolve()),
            backup=backup,
            carried=carried,
        )
        rep.late = list(plan.late)
        return rep

    def _record_late(self, late: list[dict[str, Any]]) -> None:
        """Record in the journal the units an apply undid for late writes (the file now
        holds them undone): ``why`` a late write, nothing kept apart."""
        units = {(p["plan_id"], str(u["key"])): u for p in self.journal.plans() for u in p["units"]}
        for x in late:
            u = units.get((x["plan_id"], str(x["unit"])))
            if x["action"] == "undone" and u is not None:
                self.journal.record_undone(x["plan_id"], u, list(u["ids"]), why="late write")

    def _recover(self) -> None:
        """Record the apply a killed run left in flight (``pending.json``: the plan and the
        digest of the file it was about to rename into place), under the caller's journal
        lock: when the file now starts with that content, the rename happened and the plan
        is recorded applied; else nothing was written."""
        p = self.journal.pending()
        if p is None:
            return
        if p.get("op") == "apply":
            try:
                data = self.path.resolve().read_bytes()
            except FileNotFoundError:
                data = b""
            n = int(p["size"])
            have = {q["plan_id"] for q in self.journal.plans()}
            ok = len(data) >= n and hashlib.sha256(data[:n]).hexdigest() == p["sha256"]
            if ok and p["plan_id"] not in have:
                self.journal.record_apply(p["plan_id"], p["units"])
        self.journal.done()

    def _replace(
        self,
        content: Records,
        extra: Any,
        sha256: str,
        size: int | None = None,
        before_rename: Any = None,
    ) -> tuple[str, int]:
        """Write ``content`` over the file if it is still as read (``sha256``), after a copy
        of it; returns the copy's path and the appended lines carried. ``before_rename(sha,
        size)`` is called with the new file's digest and length just before the rename. A
        JSONL file whose
        first ``size`` bytes are still as read has only had lines appended since: those
        lines are carried into the file written, after ``content``'s rows.

        Raises:
            ValueError: the file changed since it was read otherwise (nothing written), or
                an agent kept appending through five tries.
        """
        import os
        import stat
        import uuid
        from datetime import datetime, timezone

        from ..store.lance import write_records_file

        real = self.path.resolve()  # a symlink: the file it names is replaced
        mode = stat.S_IMODE(os.stat(real).st_mode)
        tmp = real.with_name(f".{real.name}.consolidated-{uuid.uuid4().hex[:8]}")
        in_file = content
        if self.write == "live":
            # the tombstones first: a crash before the rename leaves them beside a file
            # whose rows of the same ids are still live, and the live rows win
            live = content.live_mask()
            self.tombstones.parent.mkdir(parents=True, exist_ok=True)
            if live.all():
                self.tombstones.unlink(missing_ok=True)
            else:
                write_records_file(content.mask(~live), self.tombstones, extra=extra)
            in_file = content.mask(live)
        backup = None
        try:
            write_records_file(in_file, tmp, extra=extra, suffix=real.suffix)
            os.chmod(tmp, mode)
            body = tmp.read_bytes()
            for _ in range(5):
                data = real.read_bytes()
                tail = self._appended(data, sha256, size)
                if backup is None:
                    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
                    backup = real.with_name(f"{real.stem}.pre-consolidate-{stamp}{real.suffix}")
                fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                with open(tmp, "wb") as f:
                    f.write(body + tail)
                    f.flush()
                    os.fsync(f.fileno())
                # checked again just before the rename: a line appended meanwhile is
                # carried by the next try
                if _sha256(real) == hashlib.sha256(data).hexdigest():
                    if before_rename is not None:
                        before_rename(hashlib.sha256(body + tail).hexdigest(), len(body + tail))
                    os.replace(tmp, real)
                    break
            else:
                raise ValueError(
                    f"{self.path} kept changing while the result was written (5 tries): "
                    f"nothing written; run the pass again"
                )
        except BaseException:
            tmp.unlink(missing_ok=True)
            if backup is not None:
                backup.unlink(missing_ok=True)  # the file is as it was: no copy is needed
            raise
        if self.write == "all":
            self.tombstones.unlink(missing_ok=True)  # its rows are in the file now
        return str(backup), tail.count(b"\n")

    def _appended(self, data: bytes, sha256: str, size: int | None) -> bytes:
        """The whole lines appended to a JSONL file read as ``sha256`` with ``size`` bytes,
        now ``data``; ``b""`` when unchanged.

        Raises:
            ValueError: the file changed otherwise (or is not JSONL, or ends in a part line).
        """
        if hashlib.sha256(data).hexdigest() == sha256:
            return b""
        if (
            size is not None
            and self.path.suffix == ".jsonl"
            and len(data) > size
            and hashlib.sha256(data[:size]).hexdigest() == sha256
            and (size == 0 or data[size - 1 : size] == b"\n")
            and data.endswith(b"\n")
        ):
            return data[size:]
        raise ValueError(
            f"{self.path} changed since it was read: nothing written; run the pass again"
            + ("" if self.path.suffix != ".jsonl" else " (only whole lines appended are carried)")
        )

    def undo(self, target: str) -> UndoReport:
        """Undo a merge or a drop, or every unit of a plan, that an apply wrote to the
        file: ``target`` is a merged id, a dropped id or a plan id (or a unique prefix, see
        :func:`~consolidate.sources.journal.match_target`). The file is rewritten as an
        apply writes it (checked, copied, replaced): a merged record becomes a tombstone
        (``deleted_reason`` ``undone``), its members live again with each other in
        ``keep_apart``; a dropped record lives again. An undone unit is recorded in the
        journal: undoing it again does nothing.

        Raises:
            UndoTargetError: ``target`` names no applied plan, merge or drop, or several.
            ValueError: the file changed while the undo ran (nothing written).
        """
        from ..pipeline.undo import undo_merge

        with self.journal.locked():
            self._recover()

        def restore(plan_id: str, units: list[dict[str, Any]]) -> dict[str, Any]:
            digest = _sha256(self.path)
            got = self._read_all()
            recs = got.records
            out: dict[str, Any] = {}
            changed = False
            for u in units:
                meta = recs.meta
                if u["kind"] == "merge":
                    back = meta["id"][meta["merged_into"].eq(u["key"]).to_numpy()].tolist()
                    hit = meta["id"].eq(u["key"]).to_numpy()
                    if hit.any() and meta["deleted_reason"][hit].eq("undone").any():
                        # undone in the file already, not yet recorded (a crash between the
                        # two): the members are live, so record them
                        out[u["key"]] = back
                        continue
                    try:
                        recs = undo_merge(recs, u["key"])
                        out[u["key"]] = back
                        changed = True
                    except (KeyError, ValueError) as e:
                        out[u["key"]] = str(e).strip("'\"")
                    continue
                at = np.flatnonzero(
                    (meta["id"].eq(u["key"]) & meta["deleted_at"].notna()).to_numpy()
                )
                if not len(at):
                    live = meta["id"].eq(u["key"]).to_numpy()
                    # live again: restored before and not yet recorded (a crash between the
                    # two), or by hand; recorded as undone either way
                    out[u["key"]] = (
                        [u["key"]] if live.any() else "no longer in the file: nothing to restore"
                    )
                    continue
                meta = meta.copy()
                meta.loc[at, "deleted_at"] = np.nan
                meta.loc[at, "deleted_reason"] = None
                recs = Records(meta, recs.vectors, origin=recs.origin)
                out[u["key"]] = [u["key"]]
                changed = True
            if changed:
                self._replace(recs, got.extra, digest)
            return out

        return undo_by_journal(self.journal, target, restore)


def append_memories(
    path: str | Path, rows: list[dict[str, Any]], state_dir: str | Path | None = None
) -> int:
    """Append memories to a JSONL memory file as an agent should while nightly applies
    run: under the lock of the file's journal folder (the one :meth:`FileSource.apply`
    holds while it checks and replaces the file), as one write of whole lines, flushed to
    disk. Returns the lines written.

    Args:
        path: the ``.jsonl`` file (made if missing).
        rows: memories in the file schema (see the module docstring); ``vector`` may be a
            NumPy array.
        state_dir: the journal folder (default ``<path>.consolidate``).

    Raises:
        ValueError: ``path`` is not a ``.jsonl`` file, or a row has no ``text``.
    """
    import os

    from .journal import Journal, default_state_dir

    p = Path(path)
    if p.suffix != ".jsonl":
        raise ValueError(f"append_memories writes JSONL files, not {p.name}")
    for k, r in enumerate(rows):
        if not isinstance(r.get("text"), str):
            raise ValueError(f"{p}: row {k} to append has no text")
    data = "".join(
        json.dumps(r, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)) + "\n"
        for r in rows
    ).encode("utf-8")
    with Journal(state_dir or default_state_dir(p)).locked():
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    return len(rows)


def _digest(path: Path) -> tuple[str, int]:
    """The file's SHA-256 (hex) and length in bytes, from one read."""
    h = hashlib.sha256()
    n = 0
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
    except FileNotFoundError:
        raise FileNotFoundError(f"memory file not found: {path}") from None
    return h.hexdigest(), n


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except FileNotFoundError:
        raise FileNotFoundError(f"memory file not found: {path}") from None
    return h.hexdigest()
