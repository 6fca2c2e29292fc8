"""Training-thread cost of the instrumentation per step: six phases, a DDP backward, the record.

    python benchmarks/instrument_hot_path.py [--steps 10000] [--find-unused] [--hidden 4 --batch 2]

What is timed is what a training thread runs per step: six ``with phase(...)`` blocks, one
backward through a small DDP model (one gloo rank in this process, 8 parameters; the hook-free
path watches 1 of them, or all 8 with ``--find-unused``: DDP's ``find_unused_parameters=True``
in both the plain and the watched model, the most the path hooks) and ``step()`` (resolve, encode, send). The baseline
is the same step with the no-op API (not initialized) and an unwatched twin of the model; a third
step, instrumented but with the unwatched model, splits the cost into the phases and record and
the hook-free gradient wait (1 or 8 post-accumulate-grad hook calls, one of them queueing, and
two autograd final callbacks). The three alternate and the medians of their per-step times are
compared (the machine is shared: medians of interleaved steps ignore other jobs' bursts). The
record goes to a Unix datagram socket read by another process (like the daemon), or to nobody
(daemon absent). A last line times ``ddp_hook_wrapper`` around a trivial comm hook, the cost a
script that registers its own hook adds per bucket.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "exporter"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import syncwatch.instrument as sw  # noqa: E402
from syncwatch.instrument import _state  # noqa: E402
from syncwatch.instrument.hooks import ddp_hook_wrapper, watch_gradients  # noqa: E402
from syncwatch.instrument.monitor import Monitor  # noqa: E402
from syncwatch.protocol import Identity  # noqa: E402
from syncwatch.sender import Sender  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "eval")
READER = "import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\ns.bind(sys.argv[1])\n" \
         "print('ready',flush=True)\nwhile True: s.recv(4096)\n"


def make_model(find_unused: bool, hidden: int):
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(4)]),
               find_unused_parameters=find_unused)


def one_step(model, x) -> int:
    t0 = time.perf_counter_ns()
    for name in PHASES:
        with sw.phase(name):
            pass
    model(x).sum().backward()
    sw.step(32)
    return time.perf_counter_ns() - t0


def measure(n: int, path: str, plain, watched, x) -> tuple[float, float, float]:
    """Median step times in us: baseline, instrumented with the unwatched model, fully
    instrumented."""
    ident = Identity("bench", 0, 0, 0, 4, "n1", os.getpid())
    monitor = Monitor(ident, Sender(path), heartbeat_seconds=5.0)
    base, calls, full = [], [], []
    for _ in range(n):
        _state.monitor = None
        base.append(one_step(plain, x))
        _state.monitor = monitor
        calls.append(one_step(plain, x))
        full.append(one_step(watched, x))
    _state.monitor = None
    monitor.flush()
    assert monitor.collective_sequence >= n, "the gradient wait was not measured"  # per bucket
    monitor.shutdown()
    return tuple(statistics.median(v) / 1000 for v in (base, calls, full))


def inner_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket)
    return fut


def wrapper_cost(n: int, path: str, rounds: int = 5) -> tuple[float, float]:
    bucket = torch.zeros(4)
    wrapped = ddp_hook_wrapper(inner_hook)
    monitor = Monitor(Identity("bench", 0, 0, 0, 4, "n1", os.getpid()), Sender(path),
                      heartbeat_seconds=0)
    _state.monitor = monitor
    base, inst = [], []
    for _ in range(rounds):
        for hook, out in ((inner_hook, base), (wrapped, inst)):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                hook(None, bucket).wait()
            out.append((time.perf_counter_ns() - t0) / n / 1000)
    _state.monitor = None
    monitor.shutdown()
    return min(base), min(inst)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--find-unused", action="store_true")
    p.add_argument("--hidden", type=int, default=4,
                   help="layer width: a wider model evicts more of the interpreter's caches; "
                        "the plain and watched models are two instances, whose own difference "
                        "(memory placement) is then of the order of the gradient wait's cost")
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    plain, watched = make_model(a.find_unused, a.hidden), make_model(a.find_unused, a.hidden)
    x = torch.randn(a.batch, a.hidden)
    watch_gradients(watched)
    print(f"hooked parameters: {sum(bool(p._post_accumulate_grad_hooks) for p in watched.parameters())}"
          f" of 8; load average {os.getloadavg()[0]:.1f}")
    d = tempfile.mkdtemp(prefix="swb-")
    live = os.path.join(d, "live.sock")
    reader = subprocess.Popen([sys.executable, "-c", READER, live], stdout=subprocess.PIPE)
    reader.stdout.readline()
    try:
        for label, path in (("daemon present (reader process)", live),
                            ("daemon absent", os.path.join(d, "absent.sock"))):
            base, calls, full = measure(a.steps, path, plain, watched, x)
            print(f"{label}: baseline {base:.2f} us/step, instrumented {full:.2f} us/step: cost "
                  f"{full - base:.2f} us/step, of which 6 phases + step record {calls - base:.2f}, "
                  f"hook-free gradient wait {full - calls:.2f}")
        base, inst = wrapper_cost(2 * a.steps, os.path.join(d, "absent.sock"))
        print(f"ddp_hook_wrapper around a trivial comm hook: {base:.2f} -> {inst:.2f} us per "
              f"bucket (+{inst - base:.2f} us)")
    finally:
        reader.kill()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
