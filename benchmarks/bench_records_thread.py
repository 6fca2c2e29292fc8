"""The records thread's own CPU per step, by how often it wakes.

    python benchmarks/bench_records_thread.py [--seconds 6] [--rounds 2] [--steps-ms 0.5,2,5,20]

A training thread runs six phases and ``step()`` per step, with a matmul and its backward
(128 x 128, ~0.3 ms, one intra-op thread) repeated inside ``backward`` until the step has lasted
``--steps-ms``: like a backward pass, torch's work evicts the interpreter's caches between
the records thread's wake-ups. The records thread replays, encodes and sends (to an absent
daemon: the send fails fast) beside it. Its CPU time (its own clock, ``pthread_getcpuclockid``)
per step is printed for the period it has (``FLUSH_SECONDS``, 0.2 s) and for 1 s, in
alternating order, ``--rounds`` times each; then what one wake-up costs with nothing to do.

Each wake-up first pays for cold caches, so the fewer per step, the less CPU per step; a longer
period also makes longer bursts (``bench_burst.py``), which is why the period is 0.2 s.
"""

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch
from _common import machine  # puts exporter/ on the path

from syncwatch.instrument.monitor import Monitor
from syncwatch.protocol import Identity
from syncwatch.sender import Sender

IDENT = Identity(train_job="bench", attempt=0, rank=1, local_rank=1, world_size=4, node="n",
                 pid=os.getpid(), gpu=-1, gpu_uuid="")
PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "eval")
POLICIES = {"every 0.2 s": {"flush_seconds": 0.2}, "every 1 s": {"flush_seconds": 1.0}}


def run(policy: dict, seconds: float, step_ms: float, absent: str) -> float:
    """The records thread's CPU in us per step."""
    a = torch.randn(128, 128)
    w = torch.randn(128, 128, requires_grad=True)
    m = Monitor(IDENT, Sender(path=absent), heartbeat_seconds=5.0, **policy)
    phases = [m.phase(name) for name in PHASES]
    backward = phases[2]
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        for p in phases:
            with p:
                if p is backward:
                    while time.perf_counter() - t0 < step_ms / 1e3:
                        (a @ w).sum().backward()
        m.step(32)
        steps += 1
    cpu = time.clock_gettime(time.pthread_getcpuclockid(m._thread.ident))
    m.shutdown()
    return cpu / steps * 1e6


def idle_wake_cost(seconds: float, sleeper: str) -> float:
    """CPU in us of one wake-up of a thread that sleeps 0.05 s at a time doing nothing, while this
    thread runs torch: in ``Lock.acquire(timeout=...)`` (as the records thread does) or in
    ``Event.wait`` (Condition's Python code on every wake-up)."""
    a = torch.randn(128, 128)
    w = torch.randn(128, 128, requires_grad=True)
    held, event = threading.Lock(), threading.Event()
    held.acquire()

    def idle():
        if sleeper == "lock":
            while not held.acquire(timeout=0.05):
                pass
        else:
            while not event.wait(0.05):
                pass
    thread = threading.Thread(target=idle)
    stop = held.release if sleeper == "lock" else event.set
    thread.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        (a @ w).sum().backward()
    cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    stop()
    thread.join()
    return cpu / (seconds / 0.05) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="length of one run (default 6)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each policy per step length")
    p.add_argument("--steps-ms", default="0.5,2,5,20", help="step lengths in ms (default 0.5,2,5,20)")
    a = p.parse_args()
    torch.set_num_threads(1)
    absent = os.path.join(tempfile.mkdtemp(), "absent.sock")
    print(f"machine: {machine()}")
    print(f"records thread CPU per step, {a.rounds} runs of {a.seconds:g} s each (median [min-max])")
    for step_ms in (float(x) for x in a.steps_ms.split(",")):
        seen = {name: [] for name in POLICIES}
        for r in range(a.rounds):
            order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
            for name in order:
                seen[name].append(run(POLICIES[name], a.seconds, step_ms, absent))
        line = ", ".join(f"{name} {statistics.median(v):.1f} us [{min(v):.1f}-{max(v):.1f}]"
                         for name, v in seen.items())
        print(f"{step_ms:g} ms steps: {line}")
    lock, event = (statistics.median(idle_wake_cost(a.seconds / 2, kind) for _ in range(a.rounds))
                   for kind in ("lock", "event"))
    print(f"one wake-up with nothing to do: {lock:.0f} us CPU sleeping in Lock.acquire(timeout) "
          f"(as shipped), {event:.0f} us in Event.wait")


if __name__ == "__main__":
    main()
