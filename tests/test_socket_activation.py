"""The daemon takes its ingest socket from systemd (deploy/systemd/syncwatch.socket).

systemd binds the socket, keeps it across daemon restarts and hands it to each daemon as fd 3
with LISTEN_FDS=1 and LISTEN_PID=<the daemon's pid> (the sd_listen_fds protocol). Here the test
plays systemd: it binds the socket, queues records in it while no daemon runs, and starts the
daemon twice on the same socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import subprocess_env
from syncwatch.stack import free_port
from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity

JOB = "activation"


def records(first: int, last: int) -> list[bytes]:
    """Step records ``first..last`` of rank 0, with cumulative totals."""
    enc = Encoder(Identity(JOB, 0, 0, 0, 1, "node-a", os.getpid()))
    out = []
    for step in range(first, last + 1):
        totals = Cumulative(steps=step, step_seconds=step * 0.1)
        out.append(enc.step(step, time.time(), 0.1, 0.0, (0.0,) * len(PHASES), step, 1.0, 0.0, totals))
    return out


def start_daemon(sock: socket.socket, port: int) -> subprocess.Popen:
    """The daemon with ``sock`` as fd 3, as systemd starts it."""
    return subprocess.Popen(activated(sys.executable, "-m", "syncwatch", "daemon",
                                      f"--listen=127.0.0.1:{port}", f"--socket={sock.getsockname()}",
                                      "--log-level=warning"),
                            stdin=sock.fileno(), env=subprocess_env(), stderr=subprocess.PIPE, text=True)


def activated(*command: str) -> list[str]:
    """``command`` run the way systemd runs a socket-activated service, for a child whose stdin is
    the socket: it moves to fd 3, and LISTEN_PID is the pid that execs ``command`` (known only
    after fork, so the shell sets it to its own, $$, and execs)."""
    return ["sh", "-c", 'export LISTEN_PID=$$ LISTEN_FDS=1; exec "$@" 3<&0 0</dev/null', "sh", *command]


def sample(port: int, name: str, **labels) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def wait_for_sample(proc, port, expected, name, **labels):
    deadline = time.monotonic() + 20
    value = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            value = sample(port, name, **labels)
        except OSError:
            value = None
        if value == expected:
            return
        time.sleep(0.1)
    pytest.fail(f"{name}{labels} = {value}, expected {expected}")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, proc.stderr.read()


def test_daemon_uses_the_inherited_socket_and_loses_nothing_across_a_restart(sock_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for record in records(1, 5):  # queued before any daemon runs
            sender.sendto(record, sock_path)
        port = free_port()
        first = start_daemon(sock, port)
        wait_for_sample(first, port, 5.0, "syncwatch_steps_total", train_job=JOB, rank="0")
        assert sample(port, "syncwatch_ingest_records_total") == 5.0
        stop(first)
        # The daemon left systemd's socket alone: still there, still accepting.
        for record in records(6, 10):
            sender.sendto(record, sock_path)
        second = start_daemon(sock, port)
        wait_for_sample(second, port, 10.0, "syncwatch_steps_total", train_job=JOB, rank="0")
        assert sample(port, "syncwatch_ingest_records_total") == 5.0  # exactly the queued five
        stop(second)
        assert os.path.exists(sock_path)
    finally:
        sender.close()
        sock.close()


def test_an_inherited_socket_for_another_path_is_an_error(sock_path, tmp_path):
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other.bind(sock_path)
    try:
        result = subprocess.run(
            activated(sys.executable, "-m", "syncwatch", "daemon", f"--listen=127.0.0.1:{free_port()}",
                      f"--socket={tmp_path / 'ingest.sock'}"),
            stdin=other.fileno(), env=subprocess_env(), capture_output=True, text=True, timeout=30)
    finally:
        other.close()
    assert result.returncode == 2
    assert "ingest.sock" in result.stderr and "systemd" in result.stderr
