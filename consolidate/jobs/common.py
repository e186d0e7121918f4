"""What the jobs share on the command line: where their configs are, and user errors as one
line. The objects they build from a config come from :mod:`consolidate.factory` (re-exported
here)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..factory import (  # noqa: F401  (re-exported for the jobs)
    as_typed,
    command_line_overrides,
    make_embedder,
    make_store,
    open_store,
    pass_cfg,
    sim_cfg,
    typed,
    write_summary,
)

log = logging.getLogger("consolidate")


#: The jobs' Hydra configs, shipped inside the package (``consolidate/conf/``).
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def _log_to_files(msg: str) -> None:
    """Write ``msg`` as an ERROR record to the log files only (the job's ``<job>.log``), so
    a failed run's folder says why; the console gets the ``error:`` line alone."""
    rec = logging.LogRecord("consolidate", logging.ERROR, __file__, 0, msg, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(rec)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can fix (bad input, bad settings, a locked or corrupt store, a
    missing file or package) into one line on stderr and exit status 2, instead of a
    traceback."""
    from hydra.errors import InstantiationException

    from ..evaluation.tasks import DatasetHashError
    from ..pipeline import MassDropError
    from ..store import (
        ConcurrentCommitError,
        CorruptStoreError,
        InvalidRecordsError,
        LockTimeoutError,
        StoreNotFoundError,
    )

    user = (
        InvalidRecordsError,
        MassDropError,
        LockTimeoutError,
        CorruptStoreError,
        StoreNotFoundError,
        ConcurrentCommitError,
        DatasetHashError,
        FileNotFoundError,
        KeyError,
        ValueError,
        ImportError,
    )
    from omegaconf.errors import MissingMandatoryValue

    try:
        try:
            yield
        except InstantiationException as e:  # a `_target_` whose constructor refused
            if isinstance(e.__cause__, user):
                raise e.__cause__ from e
            raise
        except MissingMandatoryValue as e:  # a `???` in the config the user did not set
            key = getattr(e, "full_key", None) or str(e)
            raise ValueError(f"{key} has no value: set it on the command line ({key}=...)") from e
    except user as e:
        # a name this package fails to import from itself is a bug, not a missing package
        own = isinstance(e, ImportError) and (e.name or "").split(".")[0] == "consolidate"
        if os.environ.get("CONSOLIDATE_DEBUG") or own:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        _log_to_files(f"error: {msg}")
        print(f"error: {msg} (CONSOLIDATE_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        # a full disk, a read-only or forbidden folder, a folder that is in the way
        if os.environ.get("CONSOLIDATE_DEBUG") or not (
            isinstance(e, (FileExistsError, PermissionError))
            or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
        ):
            raise
        _log_to_files(f"error: {e}")
        print(f"error: {e} (CONSOLIDATE_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)
