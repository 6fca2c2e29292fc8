"""Backward time with DDP's built-in all-reduce, syncwatch's default hook-free measurement (the
built-in plus post-accumulate-grad hooks and two autograd callbacks), torch's Python
``allreduce_hook``, and syncwatch's ``ddp_hook_wrapper`` around it, in the same 4 processes,
round robin (isolates what measuring the gradient wait costs in backward).

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        benchmarks/instrument_hook_cost.py [steps]

Rank 0 prints per arm the median backward wall time and the mean process CPU time per backward.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "exporter"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import syncwatch.instrument as sw  # noqa: E402

HIDDEN = 512


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", type=int, nargs="?", default=150, help="steps per arm (default 150)")
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    def make():
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN)))
    arms = {name: make() for name in ("builtin", "hook_free", "torch_hook", "wrapper")}
    arms["torch_hook"].register_comm_hook(None, allreduce_hook)
    sw.init(exchange_every=0, job="hook-cost")
    sw.register(arms["hook_free"], collectives=False)
    sw.register(arms["wrapper"], hook=allreduce_hook, collectives=False)
    x, y = torch.randn(64, HIDDEN), torch.randn(64, HIDDEN)
    wall = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    order = list(arms.items())
    for i in range(steps):
        for name, model in order[i % len(order):] + order[:i % len(order)]:  # rotated
            loss = nn.functional.mse_loss(model(x), y)
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss.backward()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    if dist.get_rank() == 0:
        for name in arms:
            print(f"{name:10s} backward: wall median {statistics.median(wall[name]) * 1e3:.3f} ms, "
                  f"process CPU mean {statistics.mean(cpu[name]) * 1e3:.3f} ms")
    sw.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
