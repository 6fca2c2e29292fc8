"""Shared test fixtures. Tests import the package from this checkout's ``exporter/``."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPORTER = ROOT / "exporter"
if str(EXPORTER) not in sys.path:
    sys.path.insert(0, str(EXPORTER))


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes that must import this checkout's syncwatch."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXPORTER), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@pytest.fixture
def sock_path(tmp_path):
    """A fresh Unix datagram socket path (short: AF_UNIX paths are limited to 107 bytes)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="sw-")
    yield os.path.join(d, "ingest.sock")
