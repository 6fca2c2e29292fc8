"""One rank of a small DDP job on the GPU, for the CUDA instrumentation tests.

Ranks share the GPUs there are (rank modulo the count) and synchronize over gloo, which carries
CUDA tensors (NCCL refuses two ranks on one GPU), or over NCCL (``--backend nccl``, one rank a
GPU). ``--slow-rank``'s forward queues a kernel that spins ``--delay`` seconds on the device
before it calls the model: the host does not wait for it, so a host clock would not see it, and
the other ranks wait it out in the gradient sync. With ``--async-wait`` the slow rank spins on a
side stream instead, where each forward also launches an ``async_op`` all-reduce, and then waits
on its work: the current stream waits there for the spin (NCCL's stream, behind the side one). With ``--instrument explicit`` the script
times its phases (on CUDA events under gloo with ``SYNCWATCH_DEVICE=cuda``); with ``none`` it
never imports syncwatch (run under ``syncwatch-run``).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def spin_cycles_per_second() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per second, measured with CUDA events after a
    warm-up that lets the SM clock rise from idle."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles, rates = 20_000_000, []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) * 1e-3))
    return sorted(rates)[-2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--instrument", choices=("explicit", "none"), default="explicit")
    p.add_argument("--async-wait", action="store_true")
    a = p.parse_args()

    dist.init_process_group(a.backend)
    rank = dist.get_rank()
    gpu = rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    # only the slow rank calibrates: two ranks' spins at once would share the GPU's time
    spin = int(a.delay * spin_cycles_per_second()) if rank == a.slow_rank else 0
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).cuda(),
                device_ids=[gpu])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sw = None
    if a.instrument == "explicit":
        import syncwatch.instrument as sw
        sw.init()
        sw.register(model)
    phase = sw.phase if sw else (lambda name: contextlib.nullcontext())
    data = torch.Generator(device="cuda").manual_seed(rank)
    side, flag = torch.cuda.Stream(), torch.ones(1, device="cuda")
    for i in range(a.steps):
        with phase("data"):
            x = torch.randn(32, 128, device="cuda", generator=data)
            y = torch.randn(32, 128, device="cuda", generator=data)
        with phase("forward"):
            if a.async_wait:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(spin)
                    work = dist.all_reduce(flag, async_op=True)
                work.wait()
            elif rank == a.slow_rank:
                torch.cuda._sleep(spin)
            loss = nn.functional.mse_loss(model(x), y)
        with phase("backward"):
            opt.zero_grad()
            loss.backward()
        with phase("optimizer"):
            opt.step()
        if sw:
            sw.step(samples=32, step=i + 1)
    torch.cuda.synchronize()
    if sw:
        sw.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
