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


def run_unprivileged(work):
    """Run ``work()`` in a forked child that dropped root (root ignores file modes) to uid and
    gid 65534 (nobody) and return what it returned (JSON round trip)."""
    import json
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            out = work()
            with os.fdopen(w, "w") as f:
                json.dump(out, f)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)


@pytest.fixture
def sock_path(tmp_path):
    """A fresh Unix datagram socket path (short: AF_UNIX paths are limited to 107 bytes)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="sw-")
    yield os.path.join(d, "ingest.sock")
