"""Session-wide test environment: the tests never touch the user's model cache or the network.

- ``CP_INFER_CACHE`` points at a fresh folder for the session, removed at its end, so that an embedded default
  model a test builds (or breaks) is never the one in ``~/.cache/cp-infer``. ``CP_INFER_TEST_CACHE=DIR`` uses
  ``DIR`` instead and keeps it (to reuse built models across runs).
- ``HF_HUB_OFFLINE=1``: every model is local; a load that would reach the hub fails instead.
- ``tests/services.py``'s fixtures (a private PostgreSQL cluster, a SeaweedFS S3 server) are available everywhere.

Both are set in ``os.environ`` before any test module is imported, so the worker processes, servers and CLI
commands the tests start inherit them; a test that sets ``CP_INFER_CACHE`` itself still wins.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# The real PostgreSQL and S3 servers of the fleet's tests (started once per session, by the first test that asks).
from tests.services import pg_url, postgres_server, s3_server, s3_url  # noqa: F401 -- fixtures

TEST_CACHE_ENV = "CP_INFER_TEST_CACHE"

_made_cache: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _made_cache
    given = os.environ.get(TEST_CACHE_ENV)
    if given:
        os.makedirs(given, exist_ok=True)
        cache = os.path.abspath(given)
    else:
        cache = _made_cache = tempfile.mkdtemp(prefix="cp-infer-test-cache-")
    # Not models.common.embedded.CACHE_ENV: importing models here would import torch before pytest has configured.
    os.environ["CP_INFER_CACHE"] = cache
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _made_cache is not None:
        shutil.rmtree(_made_cache, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    return f"model cache: CP_INFER_CACHE={os.environ.get('CP_INFER_CACHE')} (HF_HUB_OFFLINE=1)"


@pytest.fixture(scope="session", autouse=True)
def _shared_worker_groups():
    """Closes the worker groups the session's tests shared (``tests/worker_groups.py``) when the session ends."""
    yield
    from .worker_groups import close_shared_groups

    close_shared_groups()
