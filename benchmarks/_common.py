"""Shared helpers for the daemon benchmarks: run a real daemon process, build records."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "exporter"))

from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity  # noqa: E402

WALL0 = 1_800_000_000.0


def parse_args(doc: str) -> argparse.Namespace:
    """The benchmark's ``--help`` (its docstring): a benchmark without options still answers
    ``--help`` instead of running in full."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser.parse_args()


class DaemonProcess:
    """``syncwatch daemon`` in its own process, on a fresh socket path and a free port."""

    def __init__(self, udp: bool = False):
        self.socket = os.path.join(tempfile.mkdtemp(prefix="sw-bench-"), "ingest.sock")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "exporter"))
        cmd = [sys.executable, "-m", "syncwatch", "daemon", "--listen", "127.0.0.1:0", "--socket",
               self.socket, "--log-level", "info"]
        if udp:
            cmd += ["--udp", "127.0.0.1:0"]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            m = re.search(r"metrics on (\S+)/metrics, ingest socket \S+, udp (\S+)", line)
            if m:
                self.url, self.udp = m.group(1), (None if m.group(2) == "off" else m.group(2))
                break
        else:
            raise RuntimeError("daemon did not start")

    def healthz(self) -> dict:
        with urllib.request.urlopen(self.url + "/healthz") as r:
            return json.load(r)

    def metrics(self) -> bytes:
        with urllib.request.urlopen(self.url + "/metrics") as r:
            return r.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def encoder(rank: int, world: int = 64, job: str = "bench") -> Encoder:
    return Encoder(Identity(job, 0, rank, rank % 8, world, f"node-{rank // 8}", 10_000 + rank))


def step_record(enc: Encoder, step: int, seconds: float = 0.1) -> bytes:
    n = len(PHASES)
    totals = Cumulative(step, step * seconds, (step * seconds / n,) * n, 0.001 * step, step // 64,
                        32.0 * step, 0.0, 0, 0, 0)
    return enc.step(step, WALL0 + step, seconds, 0.002, (seconds / n,) * n, 2 * step, 32.0, 0.0,
                    totals, exact=True)


def median(xs):
    return statistics.median(xs)


def machine() -> str:
    """The machine and how loaded it is: ``struct.pack`` of 10 doubles is ~110 ns on an idle core
    of this VM type; a larger figure means the numbers below are inflated by that factor."""
    import platform
    import struct
    import timeit
    s = struct.Struct("<10d")
    n = 200_000
    pack_ns = min(timeit.repeat(lambda: s.pack(1., 2., 3., 4., 5., 6., 7., 8., 9., 10.),
                                number=n, repeat=3)) / n * 1e9
    return (f"{os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}, calibration struct.pack(10 doubles) via lambda "
            f"{pack_ns:.0f} ns")
