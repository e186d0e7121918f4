"""The store's dataset and its integrity: the marker, opening a version, transaction
properties, and the checksums of every file a version reads (``CHECKSUMS.json``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..store import (
    POINTER,
    CorruptStoreError,
    Pointer,
    StoreBase,
    StoreNotFoundError,
    _plain_name,
    _write_atomic,
)

log = logging.getLogger("consolidate")

DATASET = "memories.lance"
FORMAT = "lance"
_P = "consolidate."
#: rows per data file written by create and a full rewrite, and the size compaction aims
#: at: a fragment this large is never rewritten by compaction (unless a tenth of its rows
#: are deleted), so a nightly compaction costs what was written since, not the store
ROWS_PER_FRAGMENT = 1 << 18
#: ``{path under memories.lance: CRC32}`` of every data and deletion file written through
#: this store; checked when a version is read
CHECKSUMS = "CHECKSUMS.json"
#: the ops whose versions have a changelog
_LOGGED = ("create", "pass", "undo", "rollback", "restore", "convert")
#: versions looked back through for the newest one that carries consolidate's properties
_MAX_LOOKBACK = 64
#: ``merged_into`` links followed from a record a delta names (a merge of merges)
_MAX_CHAIN = 64
#: rows per batch when a load streams the dataset (the vectors of one batch are the only
#: copy a load holds besides its output: 64 Ki rows x 384 x 4 B = 96 MiB)
SCAN_BATCH = 1 << 16


def _lance() -> Any:
    try:
        import lance
    except ImportError as e:  # pragma: no cover - pylance is a dependency
        raise ImportError("the Lance store needs pylance (pip install pylance)") from e
    return lance


def _index(ds: Any) -> None:
    """Build the scalar indexes of a dataset just written whole (each one a Lance version):
    a BTREE on ``id`` (appends, touches and patches look their ids up) and one on
    ``namespace`` (a load of some namespaces reads only their rows; BTREE, not BITMAP, as a
    fleet may hold millions of namespaces). Rows appended later are scanned until
    :meth:`LanceStore.cleanup` folds them into the indexes."""
    ds.create_scalar_index("id", "BTREE")
    ds.create_scalar_index("namespace", "BTREE")


def _reindex_if_lost(ds: Any) -> None:
    """Rebuild the ``id`` and ``namespace`` indexes of :func:`_index` when the newest version
    lacks one (a process killed between a rewrite and its index build), with a warning."""
    have = {f for ix in ds.describe_indices() for f in ix.field_names}
    for col in ("id", "namespace"):
        if col not in have:
            log.warning(
                "%s (version %s) had no index on %r (a write was interrupted before it was "
                "built): rebuilt",
                ds.uri,
                ds.version,
                col,
            )
            ds.create_scalar_index(col, "BTREE")


def _digest(files: Sequence[str], crc: Mapping[str, int]) -> str:
    """The content digest of a version: SHA-256 over its data and deletion files' paths and
    CRC32s, sorted (``"-"`` where a file has no recorded CRC32). Data files are immutable
    and every version lists its files, so the digest changes exactly when the version's
    rows could: a fragment or deletion file added, dropped or rewritten. CRC32 detects
    accidental damage, not a forgery."""
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(f"{p}\t{crc.get(p, '-')}\n".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _lance_errors(dataset: Path, version: int | None) -> Iterator[None]:
    """Turn a panic inside Lance (pyo3's ``PanicException``, a ``BaseException``) into a
    :class:`CorruptStoreError` naming the dataset and the version."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        first = (str(e).strip().splitlines() or ["?"])[0][:300]
        raise CorruptStoreError(
            f"Lance cannot read {dataset}"
            f"{'' if version is None else f' at version {version}'} (it panicked: {first}); "
            f"a file of the dataset is damaged: `consolidate-versions action=verify` names it"
        ) from None


def _crc32(path: Path, block: int = 8 << 20) -> int:
    """CRC32 of a file, read in 8 MiB blocks."""
    c = 0
    with open(path, "rb") as f:
        while b := f.read(block):
            c = zlib.crc32(b, c)
    return c


def _txn_props(ds: Any, version: int) -> dict[str, str]:
    """The transaction properties of one version; ``{}`` where there are none or Lance
    cannot read that version's transaction (it raises on some of its own index commits)."""
    try:
        txn = ds.read_transaction(version)
    except Exception:  # noqa: BLE001 - any failure means "no properties of ours"
        return {}
    return dict(getattr(txn, "transaction_properties", None) or {})


class LanceDataset(StoreBase):
    """The dataset under a Lance store: its marker, versions, transaction properties and
    checksums (the base of :class:`~consolidate.store.lance.LanceStore`).

    Args:
        retention_h: :meth:`~consolidate.store.lance.LanceStore.cleanup` removes versions
            older than this many hours.
        **kwargs: see :class:`~consolidate.store.store.StoreBase`.
    """

    def __init__(
        self, root: str | os.PathLike, *, retention_h: float = 7 * 24, **kwargs: Any
    ) -> None:
        super().__init__(root, **kwargs)
        if not retention_h >= 0:
            raise ValueError(f"retention_h must be >= 0, got {retention_h!r}")
        self.retention_h = float(retention_h)

    def options(self) -> dict[str, Any]:
        """The constructor settings of this handle (with ``retention_h``)."""
        return {**super().options(), "retention_h": self.retention_h}

    def namespaces(self) -> set[str]:
        """Every namespace of the store, live or not: one column of the newest version."""
        t = self._open().to_table(columns=["namespace"])
        return set(t.column("namespace").unique().to_pylist())

    # ------------------------------------------------------------ marker and dataset
    @property
    def dataset_path(self) -> Path:
        return self.root / DATASET

    def _marker(self) -> dict[str, Any]:
        try:
            text = self.pointer_path.read_text()
        except FileNotFoundError:
            raise StoreNotFoundError(f"no store at {self.root} (missing {POINTER})") from None
        except NotADirectoryError:
            raise StoreNotFoundError(f"{self.root} is not a directory") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CorruptStoreError(f"{self.pointer_path} cannot be read: {e}") from None
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise ValueError("not a Lance store marker")
            if d.get("dataset") != DATASET:
                raise ValueError(f"dataset {d.get('dataset')!r} is not {DATASET!r}")
            dim = d.get("dim")
            if not (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1):
                raise ValueError(f"dim {dim!r} is not a positive integer")
            return d
        except ValueError as e:
            raise CorruptStoreError(
                f"{self.pointer_path} is not a valid Lance store marker "
                f"({e}); the dataset {self.dataset_path} is untouched"
            ) from None

    def _open(self, version: int | None = None) -> Any:
        """The dataset at ``version`` (default: the newest), after its manifest was checked
        against the CRC32 recorded for it (:meth:`_check_manifest`).

        Raises:
            CorruptStoreError: the manifest differs from its CRC32, the version is not
                retained, or Lance cannot open it (a panic inside Lance included); the
                message names the dataset and the version."""
        lance = _lance()
        newest = self._check_manifest(version)
        try:
            with _lance_errors(self.dataset_path, version):
                ds = lance.dataset(str(self.dataset_path))
                if version is None and newest is not None and ds.version < newest:
                    # Lance found its newest version by a hint file or a listing that
                    # disagrees with the manifests on disk: never read an older version
                    raise CorruptStoreError(
                        f"{self.dataset_path}: Lance opened version {ds.version}, but the "
                        f"newest manifest on disk is of version {newest} "
                        f"(_versions/latest_version_hint.json damaged?); nothing read"
                    )
                return ds if version is None else ds.checkout_version(int(version))
        except (OSError, ValueError, RuntimeError) as e:
            if version is not None and "not found" in str(e).lower():
                raise CorruptStoreError(
                    f"version {version} of {self.dataset_path} is not retained (removed by "
                    f"cleanup after store.retention_h, or never written); "
                    f"`consolidate-versions` lists the versions kept"
                ) from e
            raise CorruptStoreError(
                f"cannot open the Lance dataset {self.dataset_path}"
                f"{'' if version is None else f' at version {version}'}: "
                f"{e}"
            ) from e

    def _manifests(self) -> dict[int, str]:
        """``{version: manifest path under the dataset folder}`` of the manifests on disk
        (Lance's names: ``_versions/<2^64-1-version>.manifest``, or ``<version>.manifest``
        in its first naming scheme); read without opening the dataset."""
        out: dict[int, str] = {}
        d = self.dataset_path / "_versions"
        for p in d.glob("*.manifest") if d.is_dir() else ():
            if p.stem.isdigit():
                n = int(p.stem)
                out[(1 << 64) - 1 - n if n >= 1 << 63 else n] = f"_versions/{p.name}"
        return out

    def _check_manifest(
        self, version: int | None, known: Mapping[str, int] | None = None
    ) -> int | None:
        """Check the manifest Lance will read for ``version`` (default: the newest on disk)
        and that version's transaction files against the CRC32s recorded for them (files
        written before they were recorded, or by another tool, are not checked). Returns
        the newest version that has a manifest on disk (``None``: none).

        ``known``: the recorded CRC32s (:meth:`_checksums`), if read already.

        Raises:
            CorruptStoreError: a file differs from its CRC32 (names it and the version)."""
        if known is None:
            known, _ = self._checksums()
        manifests = self._manifests()
        if not known or not manifests:
            return max(manifests, default=None)
        v = max(manifests) if version is None else int(version)
        paths = [manifests[v]] if v in manifests else []
        paths += [
            f"_transactions/{p.name}"
            for p in (self.dataset_path / "_transactions").glob(f"{v - 1}-*.txn")
        ]
        for rel in paths:
            if rel in known and _crc32(self.dataset_path / rel) != known[rel]:
                kind = "manifest" if rel.endswith(".manifest") else "transaction file"
                raise CorruptStoreError(
                    f"{self.dataset_path / rel} ({kind} of version {v}) does not match the "
                    f"CRC32 recorded when it was written "
                    f"(a flipped bit, a partial copy): nothing read; restore it from a backup"
                )
        return max(manifests)

    def _props(self, ds: Any) -> dict[str, str]:
        """consolidate's properties of ``ds``'s version, or of the newest older version that
        has them (Lance's own commits, such as compaction, carry none).

        Raises:
            CorruptStoreError: none within :data:`_MAX_LOOKBACK` versions.
        """
        v = ds.version
        known: Mapping[str, int] | None = None
        for _ in range(_MAX_LOOKBACK):
            if v < 1:
                break
            if v != ds.version:  # the older version's transaction file
                if known is None:
                    known, _ = self._checksums()
                self._check_manifest(v, known)
            props = _txn_props(ds, v)
            if _P + "folded" in props:
                return props
            v -= 1
        raise CorruptStoreError(
            f"{self.dataset_path}: no version at or before {ds.version} carries consolidate's "
            f"properties (within {_MAX_LOOKBACK} versions); the dataset was written by "
            f"another tool"
        )

    @staticmethod
    def _folded(props: Mapping[str, str]) -> tuple[str, ...]:
        try:
            names = json.loads(props.get(_P + "folded", "[]"))
            if not (
                isinstance(names, list)
                and all(
                    _plain_name(n) and n.endswith((".touch.json", ".patch.json")) for n in names
                )
            ):
                raise ValueError
        except ValueError:
            # a crafted name must not make a commit delete a file outside deltas/
            raise CorruptStoreError(
                "consolidate.folded is not a JSON list of delta file names"
            ) from None
        return tuple(names)

    @staticmethod
    def _vector_dtype(schema: pa.Schema) -> str:
        t = schema.field("vector").type
        if "vector_scale" in schema.names:
            return "int8"
        v = t.value_type
        return {pa.float32(): "fp32", pa.float16(): "fp16", pa.uint16(): "bf16"}[v]

    # ------------------------------------------------------------ checksums
    def _tracked(self, ds: Any, kinds: Sequence[str], since: int | None = None) -> list[str]:
        """The files of the ``kinds`` Lance tracks (``"data file"``, ``"deletion file"``,
        ``"manifest"``, ``"transaction file"``, ``"index file"``) for ``ds``'s version (with
        ``since``: for every version from ``since`` to it), as sorted paths under the
        dataset folder.

        Raises:
            CorruptStoreError: a path that leaves the dataset folder.
        """
        lo = ds.version if since is None else since
        t = ds.tracked_files(min_version=lo).read_all().to_pandas()
        t = t[t["version"].between(lo, ds.version) & t["type"].astype(str).isin(list(kinds))]
        root = self.dataset_path.resolve()
        out = []
        for p in sorted(set(t["path"].astype(str))):
            full = (root / p).resolve()
            if root not in full.parents:
                raise CorruptStoreError(
                    f"{self.dataset_path} (version {ds.version}) names "
                    f"a file outside its folder: {p!r}"
                )
            out.append(p)
        return out

    def _files(self, ds: Any) -> list[str]:
        """Data and deletion files of ``ds``'s version, as paths under the dataset folder.

        Raises:
            CorruptStoreError: a path that leaves the dataset folder.
        """
        return self._tracked(ds, ("data file", "deletion file"))

    def _checksums(self) -> tuple[dict[str, int], dict[str, str]]:
        """``(files, versions)`` from :data:`CHECKSUMS`: the CRC32 of each data and
        deletion file (path under the dataset folder) and the content digest of each
        version (:func:`_digest`). A file of the first layout (a map of files only) reads
        with no digests.

        Raises:
            CorruptStoreError: the file cannot be read or is not of that form."""
        path = self.root / CHECKSUMS
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            if self._keeps_checksums():
                raise CorruptStoreError(
                    f"{path} is missing, and {self.pointer_path} records that this store keeps "
                    f"checksums: nothing read (without it no file could be checked); restore "
                    f"it from the same backup as {DATASET}"
                ) from None
            return {}, {}
        except (OSError, ValueError) as e:
            raise CorruptStoreError(
                f"{path} cannot be read ({e}); move it aside to load "
                f"without checking the data files"
            ) from None
        files, versions = d, {}
        if isinstance(d, dict) and set(d) == {"files", "versions"}:
            files, versions = d["files"], d["versions"]
        if not (
            isinstance(files, dict)
            and all(
                isinstance(k, str)
                and not k.startswith("/")
                and ".." not in k.split("/")
                and isinstance(v, int)
                and not isinstance(v, bool)
                for k, v in files.items()
            )
            and isinstance(versions, dict)
            and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, str)
                for k, v in versions.items()
            )
        ):
            raise CorruptStoreError(
                f"{path} is not a map of file names (under "
                f"{DATASET}) to CRC32 values and of versions to "
                f"digests; move it aside to load without checking the "
                f"data files"
            )
        return files, versions

    def _keeps_checksums(self) -> bool:
        """Whether ``CURRENT`` records that :data:`CHECKSUMS` exists (every store created
        or committed to since the marker recorded it); ``False`` while the store is being
        created."""
        try:
            d = json.loads(self.pointer_path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(d, dict) and d.get("checksums") is True

    def _check_present(self, ds: Any) -> list[str]:
        """The data and deletion files of ``ds``'s version, all present on disk.

        Raises:
            CorruptStoreError: one is missing (nothing is written on a damaged store).
        """
        files = self._files(ds)
        missing = [p for p in files if not (self.dataset_path / p).is_file()]
        if missing:
            raise CorruptStoreError(
                f"{self.dataset_path} (version {ds.version}) is missing {missing[:3]}: "
                f"nothing written; restore the files from a backup or roll back to a version "
                f"without them"
            )
        return files

    def _record_checksums(self, ds: Any, *, prune: bool = False) -> None:
        """Checksum the files of ``ds``'s version not yet recorded, record the version's
        content digest, and forget files that are neither in it nor on disk; with
        ``prune`` (after versions were removed), also the digests of versions no longer
        kept (listing the versions reads every manifest: not at every append). Hold
        ``WRITERS.LOCK`` (or the store is being created).

        Raises:
            CorruptStoreError: a file of the version is missing.
        """
        for tmp in self.root.glob(f".{CHECKSUMS}.tmp-*"):  # left by a killed write; we
            tmp.unlink(missing_ok=True)  # hold WRITERS.LOCK, so none is being written now
        known, versions = self._checksums()
        files = self._check_present(ds)
        since = max((int(v) for v in versions), default=0) + 1
        meta_files = self._meta_files(ds, since=min(since, ds.version))
        known.update(
            {p: _crc32(self.dataset_path / p) for p in files + meta_files if p not in known}
        )
        current = set(files) | set(meta_files)
        for p in [p for p in known if p not in current and not (self.dataset_path / p).exists()]:
            del known[p]
        versions[str(ds.version)] = _digest(files, known)
        if prune:
            kept = {str(v["version"]) for v in ds.versions()}
            versions = {k: v for k, v in versions.items() if k in kept}
        _write_atomic(
            self.root / CHECKSUMS,
            lambda f: f.write_text(json.dumps({"files": known, "versions": versions})),
            crash_tag="checksums",
        )
        if self.pointer_path.exists() and not self._keeps_checksums():
            marker = {**self._marker(), "checksums": True}  # a store of an older layout
            _write_atomic(self.pointer_path, lambda p: p.write_text(json.dumps(marker)))

    def _meta_files(self, ds: Any, since: int | None = None) -> list[str]:
        """The manifest, transaction and index files of ``ds``'s version (with ``since``:
        of every version from ``since`` to it, such as the index versions a create writes
        after its data) that are on disk, as paths under the dataset folder (Lance reads
        them beside the data files).

        Raises:
            CorruptStoreError: a path that leaves the dataset folder."""
        kinds = ("manifest", "transaction file", "index file")
        return [p for p in self._tracked(ds, kinds, since) if (self.dataset_path / p).is_file()]

    def verify(
        self,
        version: int | None = None,
        *,
        fragments: Iterable[int] | None = None,
        meta: bool = False,
    ) -> dict[str, Any]:
        """Check a version (default: the newest) against what was recorded when it was
        written: its list of data and deletion files and their CRC32s against the
        version's content digest (so a fragment dropped from or added to the version is
        found), then the CRC32 of each file read back.

        Args:
            fragments: read back only the files of these fragment ids (a load of some
                namespaces checks the fragments that hold its rows); the digest still
                covers every file of the version.
            meta: with ``fragments=None``, the version's manifest, transaction and index
                files too (the manifest and transaction files of the version a load reads
                are checked when it is opened, :meth:`_check_manifest`).

        Returns:
            ``{"files", "checked", "unrecorded", "digest"}``: files read back and matched,
            files with no recorded checksum (written by another tool, or by a write that
            crashed before it recorded them: not checked), and whether the version's
            digest was recorded and matched (``False``: none recorded).

        Raises:
            CorruptStoreError: the files differ from the digest, or a file from its
                checksum, or is missing (names the file and the version).
        """
        ds = self._open(version)
        known, versions = self._checksums()
        files = self._files(ds)
        newest = max((int(v) for v in versions), default=0)
        on_disk = max(self._manifests(), default=0)
        if newest > on_disk:  # digests are recorded after their commit
            raise CorruptStoreError(
                f"{self.dataset_path}: version {newest} was written, but the dataset's newest "
                f"version is {on_disk} (its newest versions were lost or an "
                f"older copy of the dataset was put in place): restore the dataset folder "
                f"from the same backup as {CHECKSUMS}"
            )
        want = versions.get(str(ds.version))
        if want is not None and _digest(files, known) != want:
            raise CorruptStoreError(
                f"{self.dataset_path} (version {ds.version}) does not hold the files it held "
                f"when it was written (a data or deletion file added, dropped or replaced): "
                f"roll back to an earlier version, or restore the dataset from a backup"
            )
        read = files
        if fragments is not None:
            sel = set(fragments)
            mine: set[str] = set()
            for f in ds.get_fragments():  # one step per fragment
                if f.fragment_id in sel:
                    mine.update("data/" + d.path for d in f.data_files())
                    if f.deletion_file():
                        mine.add(f.deletion_file())
            read = [p for p in files if p in mine]
        elif meta:  # the version's manifest, transaction and index files too
            read = files + self._meta_files(ds)
        for p in read:
            if p in known:
                self._check_crc(p, known[p], ds.version)
        return {
            "files": len(read),
            "checked": sum(p in known for p in read),
            "unrecorded": sum(p not in known for p in read),
            "digest": want is not None,
        }

    def _check_crc(self, p: str, want: int, version: int) -> None:
        """File ``p`` of the dataset (a path inside it) against its recorded CRC32.

        Raises:
            CorruptStoreError: the file is missing or its CRC32 differs (says how to mend).
        """
        try:
            got = _crc32(self.dataset_path / p)
        except FileNotFoundError:
            raise CorruptStoreError(
                f"{self.dataset_path / p} of version {version} is missing"
            ) from None
        if got != want:
            raise CorruptStoreError(
                f"{self.dataset_path / p} of version {version} does not match the "
                f"CRC32 recorded when it was written (a flipped bit, a partial copy): "
                + (
                    "an index (derived data): `consolidate-versions action=reindex` rebuilds it"
                    if p.startswith("_indices/")
                    else "restore it from a backup, or roll back to a version without it"
                )
            )

    def verify_all(self) -> list[dict[str, Any]]:
        """:meth:`verify` every retained version, oldest first: every data, deletion,
        manifest, transaction and index file each one lists.

        Returns:
            One ``{"version", "files", "checked", "unrecorded", "digest"}`` or ``{"version",
            "error"}`` (the one-line message of the damage found) per version.

        Raises:
            CorruptStoreError: the dataset cannot be opened at all, or
                :data:`CHECKSUMS` cannot be read."""
        self._checksums()
        out: list[dict[str, Any]] = []
        for v in sorted(int(x["version"]) for x in self._open().versions()):
            try:
                out.append({"version": v, **self.verify(v, meta=True)})
            except CorruptStoreError as e:
                out.append({"version": v, "error": str(e)})
        return out

    def verify_in_thread(
        self, version: int, fragments: Iterable[int] | None = None
    ) -> tuple[threading.Thread, dict[str, Any]]:
        """Start :meth:`verify` of ``version`` (of ``fragments``) in a thread (CRC32
        releases the GIL, so it runs while Lance reads the same files). Returns ``(thread,
        result)``: after ``thread.join()``, ``result["error"]`` holds the exception it
        raised, if any."""
        check: dict[str, Any] = {}
        fragments = None if fragments is None else list(fragments)

        def run() -> None:
            try:
                check["out"] = self.verify(version, fragments=fragments)
            except BaseException as e:  # noqa: BLE001 - the caller re-raises it
                check["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, check

    def head(self) -> Pointer:
        """The newest version as a :class:`~consolidate.store.store.Pointer` (``snapshot`` is
        the dataset's name, ``rows`` its row count)."""
        d = self._marker()
        ds = self._open()
        props = self._props(ds)
        lp = props.get(_P + "last_pass_at")
        return Pointer(
            ds.version,
            DATASET,
            props.get(_P + "changelog"),
            d["dim"],
            self._folded(props),
            float(d.get("created_at", 0.0)),
            float(lp) if lp else None,
            self._vector_dtype(ds.schema),
            None,
            ds.count_rows(),
        )

    def snapshots(self) -> list[int]:
        """Lance versions present (retained history), ascending."""
        return sorted(int(v["version"]) for v in self._open().versions())

    def versions(self) -> list[dict[str, Any]]:
        """Every retained version: ``version``, ``timestamp`` (UTC), ``op`` (create, append,
        pass, undo, convert; ``None`` for Lance's own commits such as compaction), ``rows``
        and ``changelog`` (the file under ``changelogs/`` for a pass or an undo)."""
        ds = self._open()
        out = []
        for v in ds.versions():
            props = _txn_props(ds, v["version"])
            out.append(
                {
                    "version": int(v["version"]),
                    "timestamp": v["timestamp"],
                    "op": props.get(_P + "op"),
                    "rows": int(v.get("metadata", {}).get("total_rows", -1)),
                    "changelog": props.get(_P + "changelog")
                    if props.get(_P + "op") in _LOGGED
                    else None,
                    "summary": json.loads(props.get(_P + "summary") or "{}")
                    if props.get(_P + "op") in _LOGGED
                    else {},
                }
            )
        return out
