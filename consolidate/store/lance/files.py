"""Records written to a plain file (Parquet, JSONL, CSV): exports and the memory files of
:mod:`consolidate.sources.files`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from ..schema import (
    Records,
    records_to_arrow,
)
from ..store import (
    _write_atomic,
)


def write_records_file(
    recs: Records,
    path: str | os.PathLike,
    dtype: str = "fp32",
    *,
    extra: pd.DataFrame | None = None,
    suffix: str | None = None,
) -> None:
    """Write ``recs`` (every record, tombstones included) to ``path``: ``.parquet`` (the
    store's Arrow schema, vectors in ``dtype``), ``.jsonl`` (one JSON object a line; times
    ISO 8601 UTC, vectors as float lists, each float written exactly) or ``.csv`` (as JSONL,
    with vectors and lists of ids as JSON arrays in their cells; every cell quoted). Written
    to a temporary file and renamed; :func:`consolidate.sources.files.read_memories` reads
    each back as it was.

    Args:
        extra: more columns, indexed by record id (a file's columns outside the schema);
            records it lacks get nulls.
        suffix: the format, when ``path``'s own suffix is not it (a temporary file).

    Raises:
        ValueError: another suffix.
    """
    import csv

    import pyarrow.parquet as pq

    path = Path(path)
    suffix = suffix or path.suffix
    if suffix not in (".parquet", ".jsonl", ".csv"):
        raise ValueError(f"{path} must end in .parquet, .jsonl or .csv")
    aligned = (
        None
        if extra is None or not len(extra.columns)
        else extra.reindex(recs.meta["id"].to_numpy())
    )
    if suffix == ".parquet":
        table = records_to_arrow(recs, dtype)
        for c in [] if aligned is None else list(aligned.columns):
            assert aligned is not None
            if c not in table.column_names:
                table = table.append_column(str(c), pa.array(aligned[c].tolist(), from_pandas=True))
        _write_atomic(path, lambda p: pq.write_table(table, p))
        return
    df = records_to_arrow(recs, dtype, with_vectors=False).to_pandas()
    df.insert(3, "vector", list(recs.vectors.astype(np.float64)))
    for c in [] if aligned is None else list(aligned.columns):
        assert aligned is not None
        if c not in df.columns:
            df[c] = aligned[c].to_numpy(object)
    for c in df.columns:  # times as ISO 8601 UTC (microseconds, as stored)
        if str(df[c].dtype).startswith("datetime64"):
            df[c] = df[c].map(lambda t: None if pd.isna(t) else t.isoformat())
    if suffix == ".jsonl":
        # Python's json writes the shortest repr of each float: it reads back to the same
        # float64 (pandas' to_json keeps 15 digits at most)
        _write_atomic(path, lambda p: _write_table_jsonl(df, p))
        return
    for c in ("vector", "source_ids", "keep_apart", "derived_from"):
        df[c] = [json.dumps([float(x) for x in v] if c == "vector" else list(v)) for v in df[c]]
    # every cell quoted: a text with a bare carriage return reads back whole
    _write_atomic(path, lambda p: df.to_csv(p, index=False, quoting=csv.QUOTE_ALL))


def _write_table_jsonl(df: pd.DataFrame, path: Path) -> None:
    """``df`` as JSON lines: NaN and None as null, arrays as lists, floats exact."""

    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, (np.bool_, np.integer)):
            return v.item()
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, list):
            return list(v)
        return v

    cols = list(df.columns)
    with open(path, "w", encoding="utf-8") as f:
        for row in df.itertuples(index=False, name=None):
            f.write(
                json.dumps(
                    {c: plain(v) for c, v in zip(cols, row, strict=True)}, ensure_ascii=False
                )
                + "\n"
            )
