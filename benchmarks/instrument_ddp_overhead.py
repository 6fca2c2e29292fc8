"""End-to-end overhead of the instrumentation on a 4-rank CPU DDP loop, and the skew exchange.

    python benchmarks/instrument_ddp_overhead.py [--world 4] [--pairs 150] [--block-steps 4] \
        [--arm full|same|hook-only|calls-only|python-hook]

Same processes, same run: every rank holds two identical DDP models, one plain (DDP's built-in
all-reduce, no syncwatch calls) and one "instrumented" (``--arm full``: ``register``, i.e. the
hook-free gradient wait and the collective wrappers, six phases, ``step``, exact skew exchange
every K = 50 steps; ``--arm same``: a second plain model, the A/A check that shows the method's
own noise floor; the other arms split syncwatch into its parts).

Method, and why. On a shared 2-core VM running 4 ranks, the wall time of a block of steps
drifts by several percent with other jobs, so a total wall ratio cannot resolve 0.5 %. So:

* Many short blocks (``--block-steps`` steps, default 4), in ``--pairs`` pairs; each pair runs
  one plain and one instrumented block back to back, in an order drawn at random per pair (the
  same draw on every rank: the models' all-reduces must match), so slow drifts and any
  first/second-in-pair bias cancel. Every block starts after a barrier.
* Three figures per block: wall time (``perf_counter``), the training thread's CPU time
  (``thread_time``: forward, backward compute, optimizer and all syncwatch calls on that
  thread; it excludes gloo's threads and time spent waiting, so other jobs on the machine
  disturb it far less than wall time) and the whole process's CPU time (``process_time``:
  adds gloo's threads and syncwatch's exchange and heartbeat threads; an exchange still
  running when its block ends is charged to the next block, whichever arm).
* Per pair the ratio instrumented / plain; reported: the median of the pair ratios over all
  ranks, with a 95 % bootstrap interval of that median (pairs resampled, 2000 times). The
  ``same`` arm run the same way gives the noise floor: an effect is resolved only where the
  ``full`` interval clears the A/A one.

Rank 0 also prints the exchange's latency (in its own thread) and the training thread's step
time with and without an exchange in flight.
"""

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "exporter"))


def rank_main(a):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import syncwatch.instrument as sw
    from syncwatch.instrument import _state

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(a.hidden, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.hidden))
    plain, inst = DDP(make()), DDP(make())
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_i = torch.optim.SGD(inst.parameters(), lr=0.01)
    m = sw.init(exchange_every=a.k if a.arm == "full" else 0, job="bench")
    if a.arm in ("full", "hook-only"):
        sw.register(inst)
    elif a.arm == "python-hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        inst.register_comm_hook(None, allreduce_hook)
    if a.arm not in ("full", "hook-only", "calls-only"):
        sw.shutdown()
    phase, end_step = sw.phase, sw.step
    if a.arm == "hook-only":
        phase, end_step = (lambda name: _state.NULL), (lambda samples: None)
    x = torch.randn(a.batch, a.hidden)
    y = torch.randn(a.batch, a.hidden)

    def plain_step():
        loss = nn.functional.mse_loss(plain(x), y)
        opt_p.zero_grad()
        loss.backward()
        opt_p.step()

    step_times = {True: [], False: []}

    def inst_step():
        busy = m.exchange.in_flight() if m.exchange else False  # an exchange runs meanwhile
        t0 = time.perf_counter()
        with phase("data"):
            pass
        with phase("forward"):
            loss = nn.functional.mse_loss(inst(x), y)
        with phase("backward"):
            opt_i.zero_grad()
            loss.backward()
        with phase("optimizer"):
            opt_i.step()
        with phase("checkpoint"):
            pass
        with phase("eval"):
            pass
        end_step(a.batch)
        step_times[busy].append(time.perf_counter() - t0)

    for _ in range(5):  # warm-up (DDP rebuilds buckets after the first iteration)
        plain_step()
        inst_step()
    rng = random.Random(a.seed)  # the same order on every rank
    clocks = (time.perf_counter, time.thread_time, time.process_time)
    ratios = [[] for _ in clocks]  # per pair: instrumented / plain, for each clock
    totals = {"plain": [0.0] * 3, "inst": [0.0] * 3}
    for _ in range(a.pairs):
        spent = {}
        for arm in rng.sample(("plain", "inst"), 2):
            fn = inst_step if arm == "inst" else plain_step
            dist.barrier()
            t0 = [c() for c in clocks]
            for _ in range(a.block_steps):
                fn()
            spent[arm] = [c() - t for c, t in zip(clocks, t0)]
            totals[arm] = [x + y for x, y in zip(totals[arm], spent[arm])]
        for r, p, i in zip(ratios, spent["plain"], spent["inst"]):
            r.append(i / p)
    ex = m.exchange
    if ex:
        ex.drain(5)
    elif a.arm != "full":
        ex = None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ratios)
    if rank == 0:
        n = a.pairs * a.block_steps
        print(f"arm {a.arm}, world {dist.get_world_size()}, hidden {a.hidden}, batch {a.batch}, "
              f"{n} steps per arm in {a.pairs} pairs of {a.block_steps}-step blocks, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"rank 0 mean step: plain {totals['plain'][0] / n * 1e3:.3f} ms, instrumented "
              f"{totals['inst'][0] / n * 1e3:.3f} ms; training-thread CPU "
              f"{totals['plain'][1] / n * 1e3:.3f} / {totals['inst'][1] / n * 1e3:.3f} ms")
        rng = random.Random(1)
        for k, label in enumerate(("wall", "training-thread CPU", "process CPU")):
            per_rank = [g[k] for g in gathered]
            pooled = [r for rr in per_rank for r in rr]
            med, lo, hi = median_interval(per_rank, rng)
            ranks = " ".join(f"{statistics.median(rr):.4f}" for rr in per_rank)
            print(f"{label:20s} ratio, median of {len(pooled)} pair ratios: {med:.4f} "
                  f"(95 % bootstrap {lo:.4f}-{hi:.4f}); per rank {ranks}")
        if ex: print(f"skew exchange (K={a.k}): {ex.windows_done} windows, "
              f"{ex.seconds / max(ex.windows_done, 1) * 1e3:.2f} ms each in its own thread, "
              f"payload 2 x {8 * a.k} bytes per rank")
        busy, idle = step_times[True], step_times[False]
        if busy:
            print(f"training-thread step time with an exchange in flight: "
                  f"{statistics.median(busy) * 1e3:.3f} ms median over {len(busy)} steps; "
                  f"without: {statistics.median(idle) * 1e3:.3f} ms over {len(idle)} steps")
    sw.shutdown()
    dist.destroy_process_group()


def median_interval(per_rank, rng, resamples: int = 2000):
    """Median of all ranks' pair ratios, and a 95 % bootstrap interval: pairs are resampled
    together across ranks (a pair is one moment of the run, shared by all ranks)."""
    pairs = list(zip(*per_rank))
    pooled = [r for pair in pairs for r in pair]
    meds = sorted(statistics.median([r for pair in rng.choices(pairs, k=len(pairs)) for r in pair])
                  for _ in range(resamples))
    return statistics.median(pooled), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--block-steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--arm", choices=("full", "hook-only", "calls-only", "python-hook", "same"), default="full",
                   help="what the second model gets: syncwatch (full), torch's Python allreduce "
                        "hook only, or nothing (A/A check of the method); hook-only / calls-only "
                        "split syncwatch into its gradient-wait measurement and its phase/step "
                        "calls")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        return rank_main(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = os.path.join(tempfile.mkdtemp(prefix="swb-"), "absent.sock")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(a.world), SYNCWATCH_SOCKET=os.environ.get("SYNCWATCH_SOCKET", sock))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", *sys.argv[1:]],
                              env=dict(env, RANK=str(r))) for r in range(a.world)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
