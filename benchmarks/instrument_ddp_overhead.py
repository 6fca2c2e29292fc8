"""End-to-end overhead of the instrumentation on a 4-rank CPU DDP loop, and the skew exchange.

    python benchmarks/instrument_ddp_overhead.py [--world 4] [--blocks 20] [--block-steps 10]

Same processes, same run: every rank holds two identical DDP models, one plain (DDP's built-in
all-reduce, no syncwatch calls) and one instrumented (``register`` hook, six phases, ``step``,
exact skew exchange every K = 50 steps). Blocks of steps alternate between them, so machine
load drifts cancel. Rank 0 prints the wall-time ratio, the exchange's latency (in its own thread)
and the training thread's step time with and without an exchange in flight.
"""

import argparse
import os
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
        phase, end_step = (lambda name: sw._NULL), (lambda samples: None)
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

    for _ in range(3):  # warm-up (DDP rebuilds buckets after the first iteration)
        plain_step()
        inst_step()
    times = {"plain": [], "inst": []}
    cpu = {"plain": 0.0, "inst": 0.0}  # process CPU time: all threads, insensitive to other jobs
    for b in range(2 * a.blocks):
        arm = "inst" if b % 2 else "plain"
        fn = inst_step if arm == "inst" else plain_step
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.block_steps):
            fn()
        times[arm].append(time.perf_counter() - t0)
        cpu[arm] += time.process_time() - c0
    ex = m.exchange
    if ex:
        ex.drain(5)
    elif a.arm != "full":
        ex = None
    if rank == 0:
        p, i = sum(times["plain"]), sum(times["inst"])
        ratios = [ti / tp for tp, ti in zip(times["plain"], times["inst"])]
        n = a.blocks * a.block_steps
        print(f"world {dist.get_world_size()}, hidden {a.hidden}, batch {a.batch}, "
              f"{n} steps per arm in {a.blocks} alternating blocks")
        print(f"mean step: plain {p / n * 1e3:.3f} ms, instrumented {i / n * 1e3:.3f} ms")
        print(f"overhead ratio (instrumented/plain, total): {i / p:.4f}; "
              f"median of block ratios: {statistics.median(ratios):.4f}")
        print(f"rank 0 process CPU per step: plain {cpu['plain'] / n * 1e3:.3f} ms, instrumented "
              f"{cpu['inst'] / n * 1e3:.3f} ms, ratio {cpu['inst'] / cpu['plain']:.4f}")
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--arm", choices=("full", "hook-only", "calls-only", "python-hook", "same"), default="full",
                   help="what the second model gets: syncwatch (full), torch's Python allreduce "
                        "hook only, or nothing (A/A check of the method); hook-only / calls-only "
                        "split syncwatch into its DDP hook and its phase/step calls")
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
