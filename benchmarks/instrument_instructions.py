"""Instructions the instrumentation adds to a training step, counted exactly by callgrind.

    python benchmarks/instrument_instructions.py [--steps 200] [--jobs 2]

Timings of a few microseconds on a shared VM move with the neighbours; instruction counts do
not (the same binary, inputs and environment give the same count whatever else the machine
does). Each arm runs in its own process under ``valgrind --tool=callgrind``: the small DDP
model and the steps of ``instrument_hot_path.py`` (one gloo rank, 4 layers of width 4, one
intra-op thread), ``--steps`` steps after 20 warm-up steps. Only those steps are counted: they
run inside one ``deque.extend(map(...))`` call, which callgrind's
``--toggle-collect=deque_extend`` brackets (this needs a CPython whose libpython keeps its
symbols, as pyenv and python.org builds do). Arms:

* ``base``: the step without any syncwatch call;
* ``noop``: six ``with phase(...)`` blocks and ``step()``, nothing initialized (the cost of the
  calls themselves, which any context-manager API has);
* ``calls``: the same, initialized: each call notes an entry;
* ``full``: and the model's gradient wait is measured (hook-free);
* ``opt``: ``base`` followed by ``zero_grad()`` and an SGD ``step()``, the baseline of
* ``auto``: the same step under zero-code mode (what ``syncwatch-run`` installs: DDP's patched
  ``forward``, optimizer hooks, the hook-free gradient wait and the collective wrappers);
* ``opt_accum`` and ``auto_accum``: ``opt`` and ``auto`` with gradient accumulation, 4
  micro-batches a step, the first 3 under ``no_sync()`` (zero-code mode marks where each of
  those backwards ends and takes the loading after it as ``data``).

``noop``, ``calls`` and ``full`` run with the C notes and again with ``SYNCWATCH_PURE_PYTHON=1``.
Printed: instructions per step, and over ``base``. Instructions are not time: after a backward
the interpreter's caches are cold, and a cold instruction costs more (``instrument_hot_path.py``
times the same steps).
"""

import argparse
import collections
import concurrent.futures
import os
import re
import subprocess
import sys

HERE = os.path.abspath(__file__)
ARMS = [("base", ""), ("noop", "C"), ("noop", "Python"), ("calls", "C"), ("calls", "Python"),
        ("full", "C"), ("full", "Python"), ("opt", ""), ("auto", "C"), ("opt_accum", ""),
        ("auto_accum", "C")]
MICRO_BATCHES = 4  # a step of the _accum arms
WARMUP = 20


def run_arm(arm: str, steps: int) -> None:
    """The measured process: set up, warm up, then ``steps`` steps inside ``deque.extend``. The
    model and the two step functions are ``instrument_hot_path``'s (its timing calls run in
    every arm alike)."""
    import torch
    import torch.distributed as dist

    import instrument_hot_path as hot
    from syncwatch.instrument import _state, auto, notes
    from syncwatch.instrument.hooks import watch_gradients
    from syncwatch.instrument.monitor import Monitor
    from syncwatch.protocol import Identity
    from syncwatch.sender import Sender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if arm.startswith("auto"):  # as syncwatch-run's sitecustomize does; the model attaches it
        os.environ.update(SYNCWATCH_SOCKET=os.path.join(os.path.dirname(HERE), "absent.sock"),
                          SYNCWATCH_JOB="bench", SYNCWATCH_HEARTBEAT="0")
        auto.install()
    model = hot.make_model(find_unused=False, hidden=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4)
    monitor = _state.monitor
    with_opt = arm in ("opt", "auto", "opt_accum", "auto_accum")
    if not with_opt and arm != "base":
        monitor = Monitor(Identity("bench", 0, 0, 0, 4, "n1", os.getpid()),
                          Sender(os.path.join(os.path.dirname(HERE), "absent.sock")),
                          heartbeat_seconds=0)
        _state.set_monitor(None if arm == "noop" else monitor)
    if arm == "full":
        watch_gradients(model)
    step_fn = hot.plain_step if with_opt or arm == "base" else hot.one_step

    def step(_):
        step_fn(model, x)
        if with_opt:
            opt.step()
            opt.zero_grad()

    def accum_step(_):
        for _ in range(MICRO_BATCHES - 1):
            with model.no_sync():
                step_fn(model, x)
        step_fn(model, x)
        opt.step()
        opt.zero_grad()

    run = accum_step if arm.endswith("_accum") else step
    for i in range(WARMUP):
        run(i)
    collections.deque(maxlen=0).extend(map(run, range(steps)))  # the counted steps
    if monitor is not None:
        _state.set_monitor(None)
        monitor.flush()
        assert arm not in ("full", "auto", "auto_accum") or monitor.collective_sequence >= steps, \
            "no gradient wait measured"
        assert not arm.startswith("auto") or monitor.last_step >= steps, \
            "zero-code mode ended no step"
    print(f"notes: {notes.IMPLEMENTATION}", flush=True)
    os._exit(0)  # no teardown: nothing after the counted steps matters


def count(arm: str, impl: str, steps: int) -> int:
    env = dict(os.environ)
    env.pop("SYNCWATCH_PURE_PYTHON", None)
    env["PYTHONHASHSEED"] = "0"  # the same dict layouts in every run: repeatable counts
    if impl == "Python":
        env["SYNCWATCH_PURE_PYTHON"] = "1"
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--toggle-collect=deque_extend",
         "--callgrind-out-file=/dev/null", sys.executable, HERE, "--arm", arm,
         "--steps", str(steps)],
        env=env, capture_output=True, text=True)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or m is None or int(m.group(1)) == 0:
        sys.exit(f"callgrind run of arm {arm} failed or counted nothing (does libpython keep "
                 f"its symbols?):\n{out.stdout}{out.stderr[-2000:]}")
    if impl and f"notes: {impl}" not in out.stdout:
        sys.exit(f"arm {arm} ran with {out.stdout.strip()}, not {impl}: is _cnotes built?")
    return int(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2, help="callgrind runs at once")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        return run_arm(a.arm, a.steps)
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        counts = dict(zip(ARMS, pool.map(lambda spec: count(*spec, a.steps), ARMS)))
    per = {spec: n / a.steps for spec, n in counts.items()}
    base = per[("base", "")]
    print(f"{a.steps} steps per arm, callgrind instructions per step; baseline {base:,.0f}")
    for impl in ("C", "Python"):
        noop, calls, full = (per[(arm, impl)] for arm in ("noop", "calls", "full"))
        print(f"notes in {impl}: instrumented +{full - base:,.0f} per step over the baseline: "
              f"the calls themselves (nothing initialized) +{noop - base:,.0f}, noting the 6 "
              f"phases and step() +{calls - noop:,.0f}, hook-free gradient wait +{full - calls:,.0f}")
    opt = per[("opt", "")]
    print(f"zero-code mode (syncwatch-run): +{per[('auto', 'C')] - opt:,.0f} per step over the "
          f"same step with an SGD step ({opt:,.0f})")
    accum = per[("opt_accum", "")]
    print(f"with gradient accumulation ({MICRO_BATCHES} micro-batches, {MICRO_BATCHES - 1} under "
          f"no_sync()): +{per[('auto_accum', 'C')] - accum:,.0f} per step over the same step "
          f"({accum:,.0f})")


if __name__ == "__main__":
    main()
