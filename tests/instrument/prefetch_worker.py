"""One rank of a small CPU ``fully_shard`` job that prefetches explicitly, as torch's FSDP2 docs
show: each step, before calling the model, ``unshard(async_op=True)`` issues the first layer's
all-gather, which FSDP waits for in that layer's pre-forward. The slow rank sleeps before
issuing it. Instrumented with the explicit API.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import syncwatch.instrument as sw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0)
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    for module in (model[0], model[2], model):
        fully_shard(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sw.init()
    sw.register(model)
    for i in range(a.steps):
        with sw.phase("data"):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x, y = torch.randn(32, 128, generator=g), torch.randn(32, 128, generator=g)
        with sw.phase("forward"):
            if rank == a.slow_rank:
                time.sleep(a.delay)
            model[0].unshard(async_op=True)  # waited for in its pre-forward
            loss = nn.functional.mse_loss(model(x), y)
        with sw.phase("backward"):
            loss.backward()
        with sw.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        sw.step(samples=32, step=i + 1)
    sw.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
