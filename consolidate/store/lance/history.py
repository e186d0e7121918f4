"""A Lance store's history: reading a version, the difference of two, rollback, restore
of ids, and export."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..schema import (
    Records,
    records_from_arrow,
)
from ..store import (
    CorruptStoreError,
    _plain_name,
)
from .files import write_records_file
from .writing import _Writing


class _History(_Writing):
    """Versions and time travel (see :class:`~consolidate.store.lance.LanceStore`)."""

    def read_version(self, version: int) -> Records:
        """The records as stored at ``version`` (no pending deltas), validated.

        Raises:
            CorruptStoreError: the version is not retained or cannot be read.
            InvalidRecordsError: a stored record is invalid.
        """
        marker = self._marker()
        ds = self._open(version)
        self.verify(version)
        recs = records_from_arrow(ds.to_table(), dim=marker["dim"])
        return self._checked(
            recs,
            dim=marker["dim"],
            source=f"{self.dataset_path} (version {version})",
            existing=None,
            reading=True,
        )

    def diff(self, a: int, b: int | None = None) -> pd.DataFrame:
        """What changed from version ``a`` to ``b`` (default: the newest), per namespace.

        Returns:
            One row per namespace (plus ``"(all)"``) and one count column per kind:
            ``added`` (new ids: appended, merged or reflection rows), ``purged`` (ids
            gone), ``merged``, ``dropped`` (floor or cap), ``deleted``, ``updated``,
            ``superseded``, ``undone`` (live at ``a``, a tombstone with that reason at ``b``),
            ``restored`` (a tombstone at ``a``, live at ``b``), ``closed`` (validity ended),
            ``touched`` (only ``last_used``/``strength`` changed).

        Raises:
            CorruptStoreError: a version is not retained.
        """
        cols = [
            "id",
            "namespace",
            "deleted_at",
            "deleted_reason",
            "valid_to",
            "last_used",
            "strength",
        ]
        ta = self._open(a).to_table(columns=cols).to_pandas()
        tb = self._open(b).to_table(columns=cols).to_pandas()
        j = ta.merge(tb, on="id", how="outer", suffixes=("_a", "_b"), indicator=True)
        ns = j["namespace_b"].where(j["namespace_b"].notna(), j["namespace_a"])
        live_a = j["deleted_at_a"].isna() & (j["_merge"] != "right_only")
        live_b = j["deleted_at_b"].isna() & (j["_merge"] != "left_only")
        both = j["_merge"] == "both"
        kind = pd.Series(np.full(len(j), None, dtype=object), index=j.index)
        kind[j["_merge"] == "right_only"] = "added"
        kind[j["_merge"] == "left_only"] = "purged"
        gone = both & live_a & ~live_b
        for why in ("merged", "deleted", "updated", "superseded", "undone"):
            kind[gone & (j["deleted_reason_b"] == why)] = why
        kind[gone & j["deleted_reason_b"].isin(["floor", "cap"])] = "dropped"
        kind[both & ~live_a & live_b] = "restored"
        closed = both & j["valid_to_a"].isna() & j["valid_to_b"].notna()
        kind[kind.isna() & closed] = "closed"
        touched = both & (
            (j["last_used_a"] != j["last_used_b"]) | (j["strength_a"] != j["strength_b"])
        )
        kind[kind.isna() & touched] = "touched"
        kinds = [
            "added",
            "purged",
            "merged",
            "dropped",
            "deleted",
            "updated",
            "superseded",
            "undone",
            "restored",
            "closed",
            "touched",
        ]
        t = pd.crosstab(ns[kind.notna()], kind[kind.notna()]).reindex(columns=kinds, fill_value=0)
        t.loc["(all)"] = t.sum()
        t.index.name = "namespace"
        return t.astype(int)

    def _created_by_passes(self, after: int) -> set[str]:
        """Ids of the rows that passes (merges, exact merges, reflections) committed in
        versions newer than ``after``, read from their changelogs.

        Raises:
            CorruptStoreError: a pass version's changelog is missing.
        """
        made: set[str] = set()
        for v in self.versions():
            if v["version"] <= after or v["op"] not in ("pass", "undo", "rollback"):
                continue
            name = v["changelog"]
            if not _plain_name(name):
                raise CorruptStoreError(
                    f"version {v['version']} names the changelog "
                    f"{name!r}, not a file name in changelogs/"
                )
            path = self.root / "changelogs" / name
            if not path.is_file():
                raise CorruptStoreError(
                    f"the changelog of version {v['version']} "
                    f"({path}) is missing: cannot tell its rows apart"
                )
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e.get("op") in ("merge", "exact_merge", "reflect") and isinstance(
                    e.get("id"), str
                ):
                    made.add(e["id"])
        return made

    def rollback(
        self, version: int, *, dry_run: bool = False, lock_timeout_s: float = 0.0
    ) -> dict[str, Any]:
        """Make version ``version``'s records current again, as a new version (history is
        kept). Records appended since then are kept (revived if a later pass merged or
        dropped them); rows that later passes made (merges, reflections) are left out;
        pending deltas are applied again. Recall bookkeeping and write-path patches folded
        after ``version`` into its rows are not replayed.

        Returns:
            the commit info (see :meth:`commit`) plus ``"diff"``: :meth:`diff` from the
            newest version to the result, as ``{namespace: {kind: count}}`` (with
            ``dry_run`` nothing is written).

        Raises:
            CorruptStoreError: ``version`` is not retained, or a later pass's changelog is
                missing.
            LockTimeoutError: another pass holds the store.
        """
        with self.lock(timeout_s=lock_timeout_s):
            snap = self.load()
            if not 1 <= int(version) <= snap.version:
                raise ValueError(f"rollback: version {version} is not in 1..{snap.version}")
            old = self.read_version(version)
            made = self._created_by_passes(version)
            cur = snap.records
            old_ids = set(old.meta["id"])
            keep = ~cur.meta["id"].isin(old_ids) & ~cur.meta["id"].isin(made)
            app = cur.mask(keep.to_numpy())
            m = app.meta.copy()
            revive = m["deleted_reason"].isin(["merged", "floor", "cap"]).to_numpy()
            m.loc[revive, "deleted_at"] = np.nan
            m.loc[revive, "deleted_reason"] = None
            m.loc[revive, "merged_into"] = None
            out = Records.concat([old, Records(m, app.vectors)], snap.dim)
            for name in snap.deltas:
                out, _ = self._apply_delta(out, name, snap.dim)
            events = [
                {
                    "op": "rollback",
                    "to_version": int(version),
                    "kept_appended": m["id"].tolist(),
                    "revived": m["id"][revive].tolist(),
                }
            ]
            info = self.commit(out, events, base=snap, dry_run=dry_run, op="rollback")
        if not dry_run:
            info["diff"] = self.diff(snap.version, info["version"]).to_dict(orient="index")
        return info

    def restore(self, ids: Sequence[str], *, lock_timeout_s: float = 0.0) -> dict[str, Any]:
        """Make tombstones live again, as a new version: each id's ``deleted_at``,
        ``deleted_reason`` and ``merged_into`` are cleared. A restored member of a merge
        stays apart from the merged record (``keep_apart``), which is kept.

        Raises:
            KeyError: an unknown id (nothing written).
            ValueError: an id is live already (nothing written).
        """
        if isinstance(ids, str):
            raise TypeError("restore() takes a list of ids, not one string")
        with self.lock(timeout_s=lock_timeout_s):
            snap = self.load()
            m = snap.records.meta.copy()
            pos = pd.Index(m["id"]).get_indexer(list(ids))
            if (pos < 0).any():
                raise KeyError(
                    f"restore: unknown id(s) in {self.root}: "
                    f"{[i for i, p in zip(ids, pos, strict=True) if p < 0][:5]}"
                )
            live = m["deleted_at"].isna().to_numpy()[pos]
            if live.any():
                raise ValueError(
                    f"restore: {[ids[int(k)] for k in np.flatnonzero(live)][:5]} are live already"
                )
            into = m["merged_into"].to_numpy(object)[pos]
            ka = m["keep_apart"].copy()
            for k, p in enumerate(pos):
                if isinstance(into[k], str):
                    ka.iat[p] = sorted(set(ka.iat[p]) | {into[k]})
            m["keep_apart"] = ka
            m.loc[pos, "deleted_at"] = np.nan
            m.loc[pos, "deleted_reason"] = None
            m.loc[pos, "merged_into"] = None
            events = [
                {
                    "op": "restore",
                    "ids": list(ids),
                    "were_merged_into": [x if isinstance(x, str) else None for x in into],
                }
            ]
            return self.commit(Records(m, snap.records.vectors), events, base=snap, op="restore")

    def export(self, path: str | os.PathLike, version: int | None = None) -> dict[str, Any]:
        """Write one version's records (default: the newest, pending deltas included) to
        ``path``: ``.parquet`` (the store's Arrow schema, vectors in the stored dtype),
        ``.jsonl`` (one JSON object a line; times ISO 8601 UTC, vectors as float lists) or
        ``.csv`` (as JSONL, with vectors and lists of ids as JSON arrays in their cells).
        Written to a temporary file and renamed. ``consolidate-import file=PATH`` reads
        each back as it was (:mod:`consolidate.sources.files`).

        Raises:
            ValueError: another suffix. CorruptStoreError: the version is not retained.
        """
        path = Path(path)
        if path.suffix not in (".parquet", ".jsonl", ".csv"):
            raise ValueError(f"export: {path} must end in .parquet, .jsonl or .csv")
        if version is None:
            snap = self.load()
            recs, version = snap.records, snap.version
        else:
            recs = self.read_version(version)
        write_records_file(recs, path, self._vector_dtype(self._open(version).schema))
        return {"path": str(path), "version": int(version), "records": len(recs)}
