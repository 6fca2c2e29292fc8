"""Training-thread cost of the instrumentation per step: six phases, the DDP hook, the step record.

    python benchmarks/instrument_hot_path.py [--steps 20000]

What is timed is exactly what a training thread runs per step: six ``with phase(...)`` blocks,
one DDP bucket through ``ddp_hook_wrapper`` (hook entry mark, inner hook, ``.then`` callback on a
completed ``torch.futures.Future``), and ``step()`` (resolve, encode, send). The baseline is the
same loop with the no-op API (not initialized) and the bare inner hook. The record goes to a
Unix datagram socket read by another process (like the daemon), or to nobody (daemon absent).
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "exporter"))

import torch  # noqa: E402

import syncwatch.instrument as sw  # noqa: E402
from syncwatch.instrument import _state  # noqa: E402
from syncwatch.instrument.hooks import ddp_hook_wrapper  # noqa: E402
from syncwatch.instrument.monitor import Monitor  # noqa: E402
from syncwatch.protocol import Identity  # noqa: E402
from syncwatch.sender import Sender  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "eval")
READER = "import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\ns.bind(sys.argv[1])\n" \
         "print('ready',flush=True)\nwhile True: s.recv(4096)\n"


def inner_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket)
    return fut


def loop(n: int, hook, bucket) -> float:
    phase, step = sw.phase, sw.step
    t0 = time.perf_counter_ns()
    for _ in range(n):
        for name in PHASES:
            with phase(name):
                pass
        hook(None, bucket).wait()
        step(32)
    return (time.perf_counter_ns() - t0) / n / 1000


def measure(n: int, path: str, rounds: int = 5) -> tuple[float, float]:
    bucket = torch.zeros(4)
    wrapped = ddp_hook_wrapper(inner_hook)
    ident = Identity("bench", 0, 0, 0, 4, "n1", os.getpid())
    monitor = Monitor(ident, Sender(path), heartbeat_seconds=5.0)
    base, inst = [], []
    for _ in range(rounds):  # interleaved, best of rounds: the machine is shared
        _state.monitor = None
        base.append(loop(n, inner_hook, bucket))
        _state.monitor = monitor
        inst.append(loop(n, wrapped, bucket))
    _state.monitor = None
    monitor.shutdown()
    return min(base), min(inst)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20000)
    a = p.parse_args()
    d = tempfile.mkdtemp(prefix="swb-")
    live = os.path.join(d, "live.sock")
    reader = subprocess.Popen([sys.executable, "-c", READER, live], stdout=subprocess.PIPE)
    reader.stdout.readline()
    try:
        for label, path in (("daemon present (reader process)", live),
                            ("daemon absent", os.path.join(d, "absent.sock"))):
            base, inst = measure(a.steps, path)
            print(f"{label}: baseline {base:.2f} us/step, instrumented {inst:.2f} us/step, "
                  f"cost {inst - base:.2f} us/step (6 phases + DDP hook + step record)")
    finally:
        reader.kill()


if __name__ == "__main__":
    main()
