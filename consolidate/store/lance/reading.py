"""Loading a Lance store: a snapshot of all or some namespaces, with the pending deltas
replayed, and the lookups appends and deltas make."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..schema import (
    Problem,
    Records,
    records_from_arrow,
)
from ..store import (
    CorruptStoreError,
    DeltaError,
    Snapshot,
    _plain_name,
)
from .dataset import _MAX_CHAIN, _P, LanceDataset, _lance_errors
from .scan import (
    _is_utf8_error,
    _read_table,
    _row_problems,
    _scan,
    _scan_past_bad_strings,
    _Stored,
)


class _Reading(LanceDataset):
    """Loads and lookups (see :class:`~consolidate.store.lance.LanceStore`)."""

    def load(
        self, *, validate_records: bool = True, namespaces: Sequence[str] | None = None
    ) -> Snapshot:
        """Read the newest version and replay the pending deltas.

        Args:
            validate_records: validate the stored records and the deltas.
            namespaces: read only these namespaces (a filtered scan; an incremental pass
                reads what fired). A delta that names an id outside them is neither applied
                nor folded by a commit of this snapshot: it stays pending for the next load.

        Raises:
            StoreNotFoundError: no store here.
            CorruptStoreError: the dataset or its properties cannot be read.
            InvalidRecordsError: a stored record or a delta is invalid (names the dataset
                version or the delta file and the record ids); in quarantine mode the bad
                rows are moved to ``quarantine/`` instead.

        A read that lists a delta file which a pass then folds and removes is repeated (up
        to 5 times).
        """
        for attempt in range(5):
            try:
                return self._load(validate_records=validate_records, namespaces=namespaces)
            except CorruptStoreError as e:
                if not isinstance(e.__cause__, FileNotFoundError) or attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _load(
        self, *, validate_records: bool = True, namespaces: Sequence[str] | None = None
    ) -> Snapshot:
        """The body of :meth:`load` (one attempt)."""
        marker = self._marker()
        listed = self._listed()  # before the version is opened: see the module docstring
        ds = self._open()
        props = self._props(ds)
        source = f"{self.dataset_path} (version {ds.version})"
        # the data files' checksums are checked before Lance decodes them (a damaged data
        # file can make Lance abort the process, which no handler catches): all files for
        # a whole load, first; for some namespaces, the files of the fragments that hold
        # their rows, found through the namespace index alone (no data file read), before
        # any column is read; without a usable index, all files
        if validate_records and namespaces is None:
            self.verify(ds.version)
        elif validate_records and namespaces is not None:
            frags = _fragments_of(ds, sorted({str(n) for n in namespaces}))
            if frags is None:
                self.verify(ds.version)
            else:
                self.verify(ds.version, fragments=frags)

        def found(addr: np.ndarray) -> None:
            if validate_records and namespaces is not None:
                self.verify(ds.version, fragments=np.unique(addr >> np.uint64(32)).tolist())

        flt = None
        if namespaces is not None:
            namespaces = sorted({str(n) for n in namespaces})
            flt = pc.field("namespace").isin(pa.array(namespaces, pa.string()))
            source += f", namespaces {namespaces[:3]}{'...' if len(namespaces) > 3 else ''}"
        widths: dict[int, int] = {}  # rows of a variable-width vector column not dim wide
        bad_strings: dict[int, list[str]] = {}
        try:
            with _lance_errors(self.dataset_path, ds.version):
                try:
                    scanned: list[tuple[pa.Table, np.ndarray | None, np.ndarray | None]] = [
                        _scan(ds, flt, marker["dim"], found, widths)
                    ]
                except (OSError, ValueError, pa.ArrowException) as e:
                    if not _is_utf8_error(e):
                        raise
                    # strings Lance cannot decode: found row by row, refused by record
                    if validate_records and namespaces is not None:
                        self.verify(ds.version)
                    widths.clear()
                    meta, vecs, addr, bad_strings = _scan_past_bad_strings(
                        ds, flt, marker["dim"], widths
                    )
                    scanned = [(meta, vecs, addr)]
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(f"cannot read {source}: {e}") from e
        extra = _row_problems(scanned[0][0], widths, bad_strings, marker["dim"])
        if extra and not validate_records:
            raise CorruptStoreError(
                f"cannot read {source}: " + "; ".join(p.describe() for p in extra)
            )
        return self._rows_snapshot(
            scanned,
            version=ds.version,
            dim=marker["dim"],
            props=props,
            deltas=listed,
            validate_records=validate_records,
            source=source,
            namespaces=namespaces,
            extra=extra,
        )

    def _rows_snapshot(
        self,
        scanned: list[tuple[pa.Table, np.ndarray | None, np.ndarray | None]],
        *,
        version: int,
        dim: int,
        props: Mapping[str, str],
        deltas: Sequence[str],
        validate_records: bool,
        source: str,
        namespaces: Sequence[str] | None,
        apply_all: bool = False,
        extra: Sequence[Problem] = (),
    ) -> Snapshot:
        """A :class:`Snapshot` of stored rows read from version ``version``: decoded,
        validated, with those of ``deltas`` applied that are not folded as of that version
        and (``namespaces`` not ``None``, unless ``apply_all``) whose replay reads only rows
        read (:meth:`_covers`).

        ``scanned`` is a one-item list ``[(table, vectors, rowaddr)]``: the stored rows
        (all columns; or, with ``vectors`` and ``rowaddr`` given, the other columns as
        :func:`_scan` returns them); it is emptied, so the Arrow table is freed as soon as
        it is decoded."""
        table, vectors, rowaddr = scanned.pop()
        try:
            # text_hash as written by this store (create and append compute it from the
            # text, nothing else writes the dataset): not recomputed at every load
            recs = records_from_arrow(table, dim=dim, stored_hashes=True, vectors=vectors)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
            raise CorruptStoreError(f"cannot read {source}: {e}") from e
        # the stored rows as read, compared by commit: the ids (Arrow), the decoded table
        # (a copy-on-write view), the vectors (read-only)
        recs.vectors.setflags(write=False)
        recs.origin = np.arange(len(recs), dtype=np.int64)
        stored = _Stored(table.column("id"), recs.meta.copy(deep=False), recs.vectors, rowaddr)
        del table
        if validate_records:
            # rows moved to quarantine stay in ``stored``: the next commit deletes them
            recs = self._checked(
                recs, dim=dim, source=source, existing=None, reading=True, extra=extra
            )
        folded = set(self._folded(props))
        applied = []
        known = None if namespaces is None or apply_all else set(recs.meta["id"])
        into = self._into(recs) if known is not None else {}
        for name in deltas:
            if name in folded or not self._covers(known, name, into):
                continue
            recs, _ = self._apply_delta(recs, name, dim, validate_records)
            applied.append(name)
        lp = props.get(_P + "last_pass_at")
        return Snapshot(
            version,
            recs,
            dim,
            tuple(applied),
            [],
            self.dataset_path,
            float(lp) if lp else None,
            stored=stored,
            namespaces=None if namespaces is None else list(namespaces),
        )

    @staticmethod
    def _into(recs: Records) -> dict[str, str]:
        """``{id: merged_into}`` of the rows of ``recs`` merged into another."""
        mi = recs.meta["merged_into"]
        sel = mi.notna().to_numpy()
        return dict(
            zip(
                recs.meta["id"].to_numpy(object)[sel].tolist(),
                mi.to_numpy(object)[sel].tolist(),
                strict=True,
            )
        )

    def _covers(self, known: set[str] | None, name: str, into: Mapping[str, str]) -> bool:
        """Every record a delta's replay reads is in ``known`` (``None``: the whole store is
        loaded): the ids it names and the records their ``merged_into`` chains (``into``,
        from :meth:`_into`) lead to (a touch of a merged record counts for the record it
        was merged into)."""
        if known is None:
            return True
        for first in self.delta_ids(name):
            i: str | None = first
            for _ in range(_MAX_CHAIN):
                if i not in known:
                    return False
                i = into.get(i)
                if not isinstance(i, str):
                    break
        return True

    def trigger(self, threshold: float) -> tuple[list[str], dict[str, float]]:
        """Which namespaces should a nightly pass process? Reads four columns (never the
        vectors or texts) and sums, per namespace, the importance of live records no pass
        has kept yet (``last_pass`` null).

        Returns:
            ``(fired, new_importance)``: the namespaces whose sum reaches ``threshold``
            (sorted), and every namespace's sum (namespaces with new records only).
        """
        t = self._open().to_table(
            columns=["namespace", "importance", "last_pass", "deleted_at"],
            filter=pc.field("last_pass").is_null() & pc.field("deleted_at").is_null(),
        )
        per = t.group_by("namespace").aggregate([("importance", "sum")]).to_pandas()
        sums = dict(zip(per["namespace"], per["importance_sum"].astype(float), strict=True))
        return sorted(n for n, v in sums.items() if v >= threshold), sums

    def _listed(self) -> list[str]:
        d = self.root / "deltas"
        if not d.exists():
            return []
        return sorted(
            p.name
            for p in d.iterdir()
            if not p.name.startswith(".") and p.name.endswith((".touch.json", ".patch.json"))
        )

    def _stored(self, ids: Sequence[Any]) -> pd.DataFrame:
        wanted = sorted({i for i in ids if isinstance(i, str)})
        if not wanted:
            return pd.DataFrame(
                {"id": pd.Series([], dtype=object), "pinned": pd.Series([], dtype=bool)}
            )
        ds = self._open()
        try:
            t, _ = _read_table(ds, columns=["id", "pinned"], filter=pc.field("id").isin(wanted))
        except (OSError, pa.ArrowException) as e:
            self._check_present(ds)  # names a missing file
            raise CorruptStoreError(
                f"cannot read the ids of {self.dataset_path} (version {ds.version}): {e}"
            ) from e
        return t.to_pandas()

    def delta_ids(self, name: str) -> list[str]:
        """The record ids a pending delta file names (a touch's ids; a patch's ids and the
        ids its ``into`` fields name).

        A delta that fails :func:`~consolidate.store.store.read_json_delta` is moved to
        ``quarantine/`` (one warning line) and names no ids.

        Raises:
            CorruptStoreError: the file cannot be read or its name is not a delta's."""
        path = self.root / "deltas" / name
        if not (_plain_name(name) and name.endswith((".touch.json", ".patch.json"))):
            raise CorruptStoreError(f"{name!r} is not a delta file name of {self.root}")
        try:
            d = self._json_delta(path)
        except DeltaError as e:
            self._quarantine_delta(path, str(e))
            return []
        except OSError as e:
            raise CorruptStoreError(
                f"cannot read delta {path}: {e}; move it out of the folder to go on without it"
            ) from e
        if "ids" in d:
            return list(d["ids"])
        ids = [p["id"] for p in d["patches"]]
        return ids + [p["into"] for p in d["patches"] if p.get("into") is not None]


def _fragments_of(ds: Any, namespaces: list[str]) -> list[int] | None:
    """The fragment ids holding rows of ``namespaces``, from the ``namespace`` index alone
    (an address-only query Lance answers without reading a data file); ``None`` when the
    column has no index or the index cannot be read (then every file must be checked
    before a scan reads them)."""
    try:
        if "namespace" not in {f for ix in ds.describe_indices() for f in ix.field_names}:
            return None
        t = ds.to_table(
            columns=[],
            filter=pc.field("namespace").isin(pa.array(namespaces, pa.string())),
            with_row_address=True,
        )
    except Exception:  # noqa: BLE001 (a damaged index: every file is checked instead)
        return None
    addr = t.column("_rowaddr").to_numpy()
    return np.unique(addr >> np.uint64(32)).tolist()
