"""Re-embed a store with another embedding model and switch to it atomically.

When an agent's embedding model changes, every stored vector must be recomputed: cosines
between vectors of two models mean nothing, and the new model's dimension may differ. A
re-embed builds a complete new store beside the old one (``<store.dir>.reembed-<UTC
time>``), then exchanges
the two folders in one ``renameat2(RENAME_EXCHANGE)`` call (Linux 3.15+): a reader or writer
that opens ``store.dir`` sees the old store or the new one, never a mix. The old store is
kept whole, history included, at ``<store.dir>.pre-reembed-<UTC time>``;
:func:`switch_stores` exchanges them back.

Concurrency (see :func:`reembed_store`): the texts are embedded while agents go on writing;
the switch itself runs under the store's writers lock (appends wait a few seconds), reads the
store again, embeds the few memories appended since and builds the shadow from that read.
Recall bookkeeping written as delta files during the switch is moved into the new store.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from .store import MemoryStore, Records
from .store.lance import open_store_dir
from .store.schema import normalise_vectors
from .store.store import _crashpoint

log = logging.getLogger("consolidate")

__all__ = ["reembed_store", "switch_stores", "exchange_dirs", "check_backup"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class _Encoder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def exchange_dirs(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Exchange the folders ``a`` and ``b`` atomically (``renameat2`` with
    ``RENAME_EXCHANGE``; both must exist on one file system).

    Raises:
        OSError: the kernel or file system cannot exchange (``ENOSYS``, ``EINVAL``), or a
            path is missing (``ENOENT``); nothing was moved.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library", str(a))
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(a), None, str(b))


def _store_kwargs(store: MemoryStore) -> dict[str, Any]:
    """The constructor settings of ``store``, for a new store like it."""
    return {**store.options(), "vector_dtype": store.vector_dtype or store.head().vector_dtype}


def _embed_unique(texts: pd.Series, encoder: _Encoder) -> tuple[pd.Index, np.ndarray]:
    """``(unique texts, float32 [u, d] unit vectors)``: each distinct text embedded once."""
    uniq = pd.Index(pd.unique(texts.astype(object)))
    vecs = np.asarray(encoder.encode(list(uniq)), dtype=np.float32)
    if vecs.ndim != 2 or len(vecs) != len(uniq):
        raise ValueError(f"the embedder returned shape {vecs.shape} for {len(uniq)} texts")
    return uniq, vecs


def _vectors_for(
    texts: pd.Series, known: pd.Index, vecs: np.ndarray, encoder: _Encoder
) -> tuple[np.ndarray, int]:
    """Vectors for ``texts``: looked up in ``known`` (one hash join), the rest embedded now.
    Returns ``(float32 [n, d], texts embedded now)``."""
    pos = known.get_indexer(texts.astype(object))
    missing = pos < 0
    out = np.empty((len(texts), vecs.shape[1]), np.float32)
    out[~missing] = vecs[pos[~missing]]
    n_new = 0
    if missing.any():
        u2, v2 = _embed_unique(texts[missing], encoder)
        if v2.shape[1] != vecs.shape[1]:
            raise ValueError(
                f"the embedder changed dimension mid-run ({vecs.shape[1]} -> {v2.shape[1]})"
            )
        out[missing] = v2[u2.get_indexer(texts[missing].astype(object))]
        n_new = len(u2)
    return out, n_new


def reembed_store(
    root: str | os.PathLike,
    encoder: _Encoder,
    *,
    model: str = "",
    lock_timeout_s: float = 0.0,
    writers_timeout_s: float = 60.0,
    backup: str | os.PathLike | None = None,
    check: Callable[[Records], None] | None = None,
) -> dict[str, Any]:
    """Re-embed every record of the store at ``root`` (tombstones included, so a restore
    brings back a vector of the new model) and switch ``root`` to the new store atomically.

    Steps: under the store's pass lock (no pass, undo or rollback meanwhile), read the head
    version and embed its distinct texts (agents keep appending and touching). Then, under
    the writers lock as well (appends wait; seconds): read the head again, embed the texts
    that appeared since, build the new store at ``<root>.reembed-<UTC time>`` (same format,
    same settings, the new dimension; its first version), move into it the
    recall-bookkeeping delta files written since the second read, exchange the two folders
    (:func:`exchange_dirs`), move the deltas written meanwhile, and rename the folder that
    now holds the old store to ``backup``. A failure before the exchange removes the new
    store and leaves ``root`` as it was; after it, the old store is never removed (a failed
    rename leaves it at ``<root>.reembed-<UTC time>``, named in the error). A symlink
    ``root`` is followed: the folder it names is switched.

    Args:
        root: the store folder.
        encoder: ``encode(list[str]) -> float32 [n, d]`` unit vectors (an
            :class:`~consolidate.embed.Embedder`); ``d`` may differ from the store's.
        model: the new model's name or folder, recorded in the new store's changelog.
        lock_timeout_s: seconds to wait for the store's pass lock.
        writers_timeout_s: seconds to wait for the writers lock.
        backup: where the old store goes (default ``<root>.pre-reembed-<UTC time>``);
            must not exist, its folder must, on ``root``'s file system (checked first).
        check: called with the new records before anything is written (e.g. a test of
            their vectors); raising stops the run with ``root`` unchanged.

    Returns:
        ``{"store", "backup", "format", "records", "texts_embedded", "late_texts",
        "late_deltas", "old_dim", "dim", "version", "seconds"}``.

    Raises:
        StoreNotFoundError: no store at ``root``.
        LockTimeoutError: a pass holds the store, or a writer holds the writers lock.
        FileExistsError: ``backup`` exists.
        FileNotFoundError: ``backup``'s folder does not exist.
        ValueError: ``backup`` is on another file system.
        OSError: the file system cannot exchange folders (nothing was switched).
        ValueError: the embedder returned vectors of the wrong shape.
    """
    t0 = time.perf_counter()
    root = Path(root).resolve()  # a symlink: the folder it names is re-embedded
    store = open_store_dir(root)
    store.head()  # StoreNotFoundError names the folder
    backup, shadow = _folders(root, backup)
    fmt = store.FORMAT
    with store.lock(timeout_s=lock_timeout_s):
        first = store.load()
        old_dim = first.dim
        known, vecs = _embed_unique(first.records.meta["text"], encoder)
        log.info(
            "re-embedded %d texts of %s (d %d -> %d)", len(known), root, old_dim, vecs.shape[1]
        )
        recs, late, moved = _switch(
            store, root, shadow, backup, (known, vecs), encoder, model, check, writers_timeout_s
        )
    head = open_store_dir(root).head()
    return {
        "store": str(root),
        "backup": str(backup),
        "format": fmt,
        "records": len(recs),
        "texts_embedded": len(known) + late,
        "late_texts": late,
        "late_deltas": moved,
        "old_dim": old_dim,
        "dim": int(recs.dim),
        "version": head.version,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _folders(root: Path, backup: str | os.PathLike | None) -> tuple[Path, Path]:
    """``(backup, shadow)``: where the old store goes (checked, see :func:`reembed_store`)
    and the folder the new store is built in (``<root>.reembed-<UTC time>``).

    Raises:
        FileExistsError: ``backup`` or the shadow folder exists.
        FileNotFoundError, ValueError: see :func:`_check_backup`.
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = (
        Path(backup).absolute()
        if backup is not None
        else root.with_name(f"{root.name}.pre-reembed-{stamp}")
    )
    _check_backup(root, out)
    shadow = root.with_name(f"{root.name}.reembed-{stamp}")
    if shadow.exists():
        raise FileExistsError(
            f"{shadow} exists: another re-embed of {root} runs, or one "
            f"was killed (it holds a store: look before removing it)"
        )
    return out, shadow


def _switch(
    store: Any,
    root: Path,
    shadow: Path,
    backup: Path,
    embedded: tuple[pd.Index, np.ndarray],
    encoder: _Encoder,
    model: str,
    check: Callable[[Records], None] | None,
    writers_timeout_s: float,
) -> tuple[Records, int, int]:
    """Under the writers lock: the head again with the texts written since embedded, the
    new store built in ``shadow``, the folders exchanged and the old store moved to
    ``backup`` (:func:`reembed_store`'s second step). Returns ``(new records, texts embedded
    late, delta files carried)``."""
    known, vecs = embedded
    exchanged = False
    try:
        with store._writers_lock(writers_timeout_s):
            snap = store.load()
            meta = snap.records.meta.copy()
            new_vecs, late = _vectors_for(meta["text"], known, vecs, encoder)
            recs = Records(meta, new_vecs)
            normalise_vectors(recs)
            if check is not None:
                check(recs)
            new = open_store_dir(shadow, format=store.FORMAT, **_store_kwargs(store))
            new.create(
                recs,
                source=f"re-embed of {root} version {snap.version} with {model or 'another model'}",
            )
            with new.lock(), new._writers_lock(writers_timeout_s):
                folded = set(snap.deltas)
                # the touches so far are copied (the live store keeps them until the
                # exchange), those written until the exchange moved after it
                copied = _copy_late_deltas(root, shadow, folded)
                _crashpoint("reembed:before_exchange")
                exchange_dirs(root, shadow)
                exchanged = True
                _crashpoint("reembed:after_exchange")
                moved = len(copied) + _move_late_deltas(shadow, root, folded | copied)
                shadow.rename(backup)
    except BaseException as e:
        if not exchanged:
            if shadow.exists():
                shutil.rmtree(shadow, ignore_errors=True)
            raise
        if shadow.exists():  # switched, but the old store could not be moved aside
            raise OSError(
                f"{root} now holds the re-embedded store; the old store stays at {shadow} ({e})"
            ) from e
        raise
    return recs, late, moved


def check_backup(root: str | os.PathLike, backup: str | os.PathLike) -> None:
    """Refuse a ``backup`` folder for :func:`reembed_store` that a rename cannot reach
    (before any model is loaded); see :func:`_check_backup`."""
    _check_backup(Path(root).resolve(), Path(backup).absolute())


def _check_backup(root: Path, backup: Path) -> None:
    """``backup`` is free and on ``root``'s file system (a rename can reach it).

    Raises:
        FileExistsError: it exists.
        FileNotFoundError: its parent folder does not.
        ValueError: another file system.
    """
    if backup.exists() or backup.is_symlink():
        raise FileExistsError(f"{backup} exists: choose another backup folder")
    if not backup.parent.is_dir():
        raise FileNotFoundError(f"backup {backup}: the folder {backup.parent} does not exist")
    if backup.parent.stat().st_dev != root.parent.stat().st_dev:
        raise ValueError(
            f"backup {backup} is on another file system than {root}: the old "
            f"store is moved there by a rename"
        )


def _late_deltas(old: Path, folded: set[str]) -> list[Path]:
    """The delta files of ``old/deltas`` not in ``folded``."""
    src = old / "deltas"
    if not src.is_dir():
        return []
    return [
        p
        for p in sorted(src.iterdir())
        if p.name not in folded and p.name.endswith((".touch.json", ".patch.json"))
    ]


def _copy_late_deltas(old: Path, new: Path, folded: set[str]) -> set[str]:
    """Copy the delta files of ``old`` not in ``folded`` into ``new`` (the originals stay
    until the exchange); returns their names."""
    (new / "deltas").mkdir(exist_ok=True)
    out = set()
    for p in _late_deltas(old, folded):
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(p, new / "deltas" / p.name)
            out.add(p.name)
    return out


def _move_late_deltas(old: Path, new: Path, folded: set[str]) -> int:
    """Move the delta files of ``old/deltas`` that the new store's records do not hold
    (not in ``folded``) to ``new/deltas``; returns how many."""
    src = old / "deltas"
    if not src.is_dir():
        return 0
    (new / "deltas").mkdir(exist_ok=True)
    n = 0
    for p in sorted(src.iterdir()):
        if p.name in folded or not p.name.endswith((".touch.json", ".patch.json")):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.replace(p, new / "deltas" / p.name)
            n += 1
    return n


def switch_stores(
    root: str | os.PathLike, other: str | os.PathLike, *, lock_timeout_s: float = 0.0
) -> dict[str, Any]:
    """Exchange the store at ``root`` with the store at ``other`` atomically (e.g. back to
    the store a re-embed kept), each under its pass and writers locks.

    Raises:
        StoreNotFoundError: either folder holds no store.
        LockTimeoutError: a pass holds either store.
        OSError: the file system cannot exchange folders (nothing moved).
    """
    a, b = open_store_dir(Path(root).resolve()), open_store_dir(Path(other).resolve())
    ha, hb = a.head(), b.head()
    if a.root.resolve() == b.root.resolve():
        raise ValueError(f"{root} and {other} are the same folder")
    with (
        a.lock(timeout_s=lock_timeout_s),
        b.lock(timeout_s=lock_timeout_s),
        a._writers_lock(),
        b._writers_lock(),
    ):
        exchange_dirs(a.root, b.root)
    return {
        "store": str(a.root),
        "other": str(b.root),
        "now_version": hb.version,
        "now_dim": hb.dim,
        "other_version": ha.version,
        "other_dim": ha.dim,
    }
