"""Training-thread cost of the instrumentation per step: six phases, a DDP backward, the record.

    python benchmarks/instrument_hot_path.py [--steps 10000] [--find-unused] [--hidden 4 --batch 2]
                                             [--device cuda]

What is timed is what a training thread runs per step: a forward and a backward through a small
DDP model (one gloo rank in this process, 8 parameters; the hook-free path watches 1 of them, or
all 8 with ``--find-unused``: DDP's ``find_unused_parameters=True``, the most the path hooks)
inside six ``with phase(...)`` blocks, and ``step()``. The records thread (replay, encoding,
send) runs beside it, as in training. Four arms, in random order within each round: the step
without any syncwatch call (the baseline), the same calls with nothing initialized (no-op), the
calls initialized with an unwatched model (phases + step), and with the watched model (adds the
hook-free gradient wait: a post-accumulate-grad hook call and two autograd final callbacks). The
two model instances swap roles every 500 steps, so that their own difference (memory placement)
cancels. Reported: medians of wall time and of this thread's CPU time (``thread_time``, which
other processes' bursts do not land in). The record goes to a Unix datagram socket read by
another process (like the daemon), or to nobody (daemon absent). Then: the phases and step in a
hot loop (caches warm), ``ddp_hook_wrapper`` around a trivial comm hook, the cost a script
that registers its own hook adds per bucket, and a blocking collective through the collective
wrapper, what each of FSDP's all-gathers and reduce-scatters pays.

``--device cuda`` runs the same on the GPU: the model, its input and the collectives' tensors
on it, one NCCL rank, and the marks are CUDA events recorded on the current stream (the
instrumentation's clock for NCCL jobs); the host waits for the device after each timed step,
outside the timing, so that the records thread finds the step's events passed, as it does a
step or so later in training.
"""

import argparse
import os
import random
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
from syncwatch.instrument import _state, notes  # noqa: E402
from syncwatch.instrument.clock import CudaEventClock, HostClock  # noqa: E402
from syncwatch.instrument.hooks import ddp_hook_wrapper, watch_gradients  # noqa: E402
from syncwatch.instrument.monitor import MAX_ENTRIES, Monitor  # noqa: E402
from syncwatch.protocol import Identity  # noqa: E402
from syncwatch.sender import Sender  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "eval")
READER = "import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\ns.bind(sys.argv[1])\n" \
         "print('ready',flush=True)\nwhile True: s.recv(4096)\n"
ARMS = ("base", "noop", "calls", "full")
BLOCK = 500  # steps between swaps of the two models' roles (watched / plain)
DEVICE = "cpu"  # --device


def new_monitor(path: str, heartbeat_seconds: float) -> Monitor:
    """The rank's monitor, sending to ``path``, with the clock of ``DEVICE``."""
    clock = CudaEventClock(device=0) if DEVICE == "cuda" else HostClock()
    return Monitor(Identity("bench", 0, 0, 0, 4, "n1", os.getpid()), Sender(path),
                   clock=clock, heartbeat_seconds=heartbeat_seconds)


def make_model(find_unused: bool, hidden: int):
    torch.manual_seed(0)
    return DDP(nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(4)]).to(DEVICE),
               find_unused_parameters=find_unused)


def clocks() -> tuple[int, int]:
    return time.perf_counter_ns(), time.thread_time_ns()


def plain_step(model, x) -> tuple[int, int]:
    """The training step without syncwatch: the baseline."""
    w, c = clocks()
    out = model(x)
    out.sum().backward()
    w1, c1 = clocks()
    return w1 - w, c1 - c


def one_step(model, x) -> tuple[int, int]:
    """The same step inside six phases, ended by ``step()``."""
    w, c = clocks()
    with sw.phase("data"):
        pass
    with sw.phase("forward"):
        out = model(x)
    with sw.phase("backward"):
        out.sum().backward()
    with sw.phase("optimizer"):
        pass
    with sw.phase("checkpoint"):
        pass
    with sw.phase("eval"):
        pass
    sw.step(32)
    w1, c1 = clocks()
    return w1 - w, c1 - c


def measure(n: int, path: str, models, x) -> tuple[dict, float]:
    """Per arm, median (wall, CPU) step times in us. Arms: no syncwatch calls; the calls with
    nothing initialized (no-op); instrumented, model not watched; fully instrumented. The two
    models swap roles (watched / plain) every BLOCK steps, so that their own difference (memory
    placement, of the order of the gradient wait's cost) cancels."""
    monitor = new_monitor(path, heartbeat_seconds=5.0)
    arms = {arm: [] for arm in ARMS}
    rng = random.Random(0)
    for block in range(max(n // BLOCK, 2)):
        watched, plain = models[block % 2], models[1 - block % 2]
        handle = watch_gradients(watched)
        for i in range(BLOCK + 5):  # the first few after a swap warm up and read DDP's buckets
            for arm in rng.sample(ARMS, len(ARMS)):  # in random order: no position effects
                _state.set_monitor(None if arm in ("base", "noop") else monitor)
                t = plain_step(plain, x) if arm == "base" else one_step(
                    watched if arm == "full" else plain, x)
                if i >= 5:
                    arms[arm].append(t)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()  # outside the timing
        handle.remove()
    _state.set_monitor(None)
    # the records thread's own CPU (replay, encoding, send) per step it recorded
    records = time.clock_gettime(time.pthread_getcpuclockid(monitor._thread.ident))
    records_per_step = records / max(monitor.totals.steps, 1) * 1e6
    monitor.flush()
    assert monitor.collective_sequence >= n, "the gradient wait was not measured"  # per bucket
    monitor.shutdown()
    return {arm: tuple(statistics.median(t[k] for t in v) / 1000 for k in (0, 1))
            for arm, v in arms.items()}, records_per_step


def warm_cost(n: int, path: str, rounds: int = 5) -> float:
    """Six phases and step() in a tight loop without backward (the interpreter's caches warm),
    minus the same loop with nothing initialized: us per step, best of ``rounds``. Timed in
    chunks whose entries fit the monitor's queue, flushed in between, outside the timing (a
    tight loop outruns the records thread's 0.2 s period)."""
    monitor = new_monitor(path, heartbeat_seconds=0)
    chunk = MAX_ENTRIES // (2 * len(PHASES) + 1)  # steps: two entries a phase, one a step
    best = {}
    for m in (None, monitor) * rounds:
        _state.set_monitor(m)
        spent = 0
        for done in range(0, n, chunk):
            t0 = time.perf_counter_ns()
            for _ in range(min(chunk, n - done)):
                for name in PHASES:
                    with sw.phase(name):
                        pass
                sw.step(32)
            spent += time.perf_counter_ns() - t0
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # the events passed: the flush resolves them
            monitor.flush()
        per = spent / n / 1000
        best[m is None] = min(best.get(m is None, per), per)
    _state.set_monitor(None)
    monitor.shutdown()
    return best[False] - best[True]


def inner_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket)
    return fut


def wrapper_cost(n: int, path: str, rounds: int = 5) -> tuple[float, float]:
    bucket = torch.zeros(4, device=DEVICE)
    wrapped = ddp_hook_wrapper(inner_hook)
    monitor = new_monitor(path, heartbeat_seconds=0)
    _state.set_monitor(monitor)
    base, inst = [], []
    for _ in range(rounds):
        for hook, out in ((inner_hook, base), (wrapped, inst)):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                hook(None, bucket).wait()
            out.append((time.perf_counter_ns() - t0) / n / 1000)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            monitor.flush()  # outside the timing: 5 rounds' entries overflowed the queue
    _state.set_monitor(None)
    monitor.shutdown()
    return min(base), min(inst)


def gather_name() -> str:
    """FSDP2's all-gather in torch 2.13, ``all_gather_single``; FSDP1's before it."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def collective_cost(n: int, path: str, rounds: int = 5) -> tuple[float, float]:
    """A blocking all-gather (FSDP's, ``gather_name()``) on the one-rank group, torch's own and
    through the collective wrapper: us per call, best of ``rounds``."""
    out, inp = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    monitor = new_monitor(path, heartbeat_seconds=0)
    _state.set_monitor(monitor)
    handle = sw.register(collectives=True)
    wrapped = getattr(dist, gather_name())
    plain = wrapped._syncwatch_original
    base, inst = [], []
    for _ in range(rounds):
        for fn, times in ((plain, base), (wrapped, inst)):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn(out, inp)
            times.append((time.perf_counter_ns() - t0) / n / 1000)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            monitor.flush()  # outside the timing: the entries fit the queue
    handle.remove()
    _state.set_monitor(None)
    monitor.shutdown()
    return min(base), min(inst)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--find-unused", action="store_true")
    p.add_argument("--hidden", type=int, default=4,
                   help="layer width: a wider model evicts more of the interpreter's caches; "
                        "the plain and watched models are two instances, whose own difference "
                        "(memory placement) is then of the order of the gradient wait's cost")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the model on GPU 0, one NCCL rank, CUDA-event marks")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here")
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    models = make_model(a.find_unused, a.hidden), make_model(a.find_unused, a.hidden)
    x = torch.randn(a.batch, a.hidden, device=DEVICE)
    with watch_gradients(models[0]):
        hooked = sum(bool(p._post_accumulate_grad_hooks) for p in models[0].parameters())
    print(f"device {DEVICE}; hooked parameters: {hooked} of 8; notes in {notes.IMPLEMENTATION}; "
          f"load average {os.getloadavg()[0]:.1f}")
    d = tempfile.mkdtemp(prefix="swb-")
    live = os.path.join(d, "live.sock")
    reader = subprocess.Popen([sys.executable, "-c", READER, live], stdout=subprocess.PIPE)
    reader.stdout.readline()
    try:
        for label, path in (("daemon present (reader process)", live),
                            ("daemon absent", os.path.join(d, "absent.sock"))):
            r, records = measure(a.steps, path, models, x)
            for k, clock in ((0, "wall"), (1, "thread CPU")):
                base, noop, calls, full = (r[arm][k] for arm in ("base", "noop", "calls", "full"))
                print(f"{label}, {clock}: baseline {base:.2f} us/step, instrumented {full:.2f}: "
                      f"cost {full - base:.2f} us/step, of which 6 phases + step() "
                      f"{calls - base:.2f} (the same calls not initialized: {noop - base:.2f}), "
                      f"hook-free gradient wait {full - calls:.2f}")
            print(f"{label}: the records thread's CPU (replay, encoding, send) {records:.2f} us "
                  f"per step recorded, beside the training thread")
        print(f"6 phases + step() in a hot loop, caches warm: {warm_cost(a.steps, live):.2f} us "
              f"per step over the same calls not initialized")
        base, inst = wrapper_cost(2 * a.steps, os.path.join(d, "absent.sock"))
        print(f"ddp_hook_wrapper around a trivial comm hook: {base:.2f} -> {inst:.2f} us per "
              f"bucket (+{inst - base:.2f} us)")
        base, inst = collective_cost(a.steps, os.path.join(d, "absent.sock"))
        print(f"a blocking collective ({gather_name()}, 1 rank) through the wrapper: "
              f"{base:.2f} -> {inst:.2f} us per call (+{inst - base:.2f} us)")
    finally:
        reader.kill()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
