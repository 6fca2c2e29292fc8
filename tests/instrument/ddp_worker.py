"""One rank of a small CPU DDP (or FSDP) training job, for the instrumentation tests and benchmarks.

Launched once per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (like
torchrun does) or by torchrun itself. ``--instrument none`` is an unmodified script: it never
imports syncwatch (the zero-code-change test runs it under ``syncwatch-run``).
"""

import argparse
import io
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--instrument", choices=("none", "explicit"), default="none")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--step-pause", type=float, default=0.0)
    p.add_argument("--out", default=None)
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="train through torch.compile(ddp, backend=BACKEND)")
    p.add_argument("--wrap", choices=("ddp", "fsdp", "fully_shard"), default="ddp",
                   help="DistributedDataParallel, or FSDP units for each layer and the whole "
                        "model: FullyShardedDataParallel or fully_shard")
    p.add_argument("--call", choices=("positional", "keyword", "dict"), default="positional",
                   help="call the model as model(x), model(x=x) (HuggingFace's model(**batch)) "
                        "or model({'x': x})")
    p.add_argument("--amp-skip", type=int, nargs="*", default=None, metavar="STEP",
                   help="train through a GradScaler, whose step() skips the optimizer's at these "
                        "steps (their loss made infinite)")
    p.add_argument("--second-model", choices=("frozen", "trained"), default=None,
                   help="a second DDP model runs forward on the same batch first, and the loss "
                        "also pulls towards its output: a frozen teacher (distillation, under "
                        "torch.no_grad) or one trained with the first (like a GAN's other half)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="after every N-th step, evaluate: 3 batches under torch.no_grad, each "
                        "20 ms slower (the time a metric would take)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="after every N-th step (and once before the loop), save the model and "
                        "the optimizer's state, each save 50 ms slower (a slow disk)")
    p.add_argument("--saver", choices=("torch", "dcp"), default="torch",
                   help="torch.save on rank 0 only (torch's DDP tutorial), or "
                        "torch.distributed.checkpoint.save on every rank")
    p.add_argument("--init-first", action="store_true",
                   help="with --instrument explicit: init() before building the model, not after")
    p.add_argument("--ignore-first", action="store_true",
                   help="DDP ignores the first layer's parameters (as for another parallelism's)")
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if a.instrument == "explicit" and a.init_first:
        import syncwatch.instrument
        syncwatch.instrument.init()
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    model = layers if a.call == "positional" else _Keyword(layers)
    if a.wrap == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        ddp = FullyShardedDataParallel(model, device_id=torch.device("cpu"),  # nested: each Linear
                                       auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    elif a.wrap == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        for layer in (layers[0], layers[2], model):
            fully_shard(layer)
        ddp = model
    else:
        kw = {"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {}
        if a.ignore_first:
            DDP._set_params_and_buffers_to_ignore_for_model(model, ["0.weight", "0.bias"])
        ddp = DDP(model, **kw)
    net = torch.compile(ddp, backend=a.compile) if a.compile else ddp
    second = None
    if a.second_model:
        torch.manual_seed(1)
        second = DDP(nn.Sequential(nn.Linear(128, 128)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    hang_group = dist.new_group([0, 1]) if a.hang_rank >= 0 else None
    scaler = torch.amp.GradScaler("cpu") if a.amp_skip is not None else None

    sw = None
    if a.instrument == "explicit":
        import syncwatch.instrument as sw
        sw.init()
        sw.register(ddp)
    phase = sw.phase if sw else (lambda name: _NoPhase())

    save_seconds = 0.0  # the saves' time within the loop, as this script measures it

    def save(tag):
        start = time.perf_counter()
        state = {"model": ddp.state_dict(), "optimizer": opt.state_dict()}
        if a.saver == "dcp":
            import torch.distributed.checkpoint as dcp
            dcp.save(state, storage_writer=_SlowWriter(os.path.join(a.out, tag)))
        elif rank == 0:
            torch.save(state, _SlowFile())
        return time.perf_counter() - start

    if a.save_every:
        save("start")

    for i in range(a.start_step, a.start_step + a.steps):
        with phase("data"):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x = torch.randn(a.batch, 128, generator=g)
            y = torch.randn(a.batch, 128, generator=g)
        if rank == a.hang_rank and i == a.hang_step:
            # blocks forever: rank 0 never joins this collective
            dist.all_reduce(torch.zeros(1), group=hang_group)
        with phase("forward"):
            if rank == a.slow_rank:
                time.sleep(a.delay)
            if second is not None:
                with torch.set_grad_enabled(a.second_model == "trained"):
                    y = (y + second(x)) / 2
            out = net(x=x) if a.call == "keyword" else net({"x": x}) if a.call == "dict" else net(x)
            loss = nn.functional.mse_loss(out, y)
            if scaler is not None:
                loss = scaler.scale(loss * (float("inf") if i in a.amp_skip else 1.0))
        with phase("backward"):
            opt.zero_grad()
            loss.backward()
        grads = [_local(q.grad).clone() for q in ddp.parameters()]
        with phase("optimizer"):
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if sw:
            sw.step(samples=a.batch, step=i + 1)
        if a.eval_every and (i + 1) % a.eval_every == 0:
            net.eval()
            with torch.no_grad():
                for _ in range(3):
                    net(x)
                    time.sleep(0.02)
            net.train()
        if a.save_every and (i + 1) % a.save_every == 0:
            save_seconds += save(f"step{i + 1}")
        if a.step_pause:
            time.sleep(a.step_pause)

    if a.out:
        weights = {n: _local(q.detach()).clone() for n, q in ddp.named_parameters()}
        torch.save({"weights": weights, "grads": grads, "save_seconds": save_seconds},
                   os.path.join(a.out, f"rank{rank}.pt"))
    if sw:
        sw.shutdown()
    dist.destroy_process_group()


def _local(t):
    """This rank's part of a parameter or gradient (FSDP's are sharded; DDP's are whole)."""
    return t.to_local() if hasattr(t, "to_local") else t


class _Keyword(nn.Module):
    """The layers behind a forward that takes its input by keyword or in a dict."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, batch=None, *, x=None):
        return self.layers(batch["x"] if x is None else x)


SAVE_DELAY = 0.05  # seconds a save of --save-every waits for its slow storage


class _SlowFile(io.BytesIO):
    """A file whose first write waits ``SAVE_DELAY``: a slow disk under ``torch.save``."""

    def write(self, b):
        if not self.tell():
            time.sleep(SAVE_DELAY)
        return super().write(b)


def _SlowWriter(path):
    """A DCP file-system writer whose writes wait ``SAVE_DELAY`` first."""
    from torch.distributed.checkpoint import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(SAVE_DELAY)
            return super().write_data(plan, planner)
    return SlowWriter(path)


class _NoPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
