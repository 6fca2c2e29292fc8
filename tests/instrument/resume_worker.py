"""An unmodified DDP script that checkpoints and resumes, as restarted by torchrun.

Launched once per rank and attempt with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and
TORCHELASTIC_RESTART_COUNT in the environment, as torchrun launches its workers (torchrun's own
restarts, on this machine, failed now and then to connect gloo's second mesh).

Every ``--save-every`` steps rank 0 saves the model, the optimizer's state and the step with
``torch.save``; at start every rank loads the latest save there is and goes on from the step
after it. In the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 0 fails right after step
``--fail-after``: torchrun restarts the job, which resumes from the last save before it and
runs the steps between the two again. Each rank writes its final weights and gradients to
``--out``.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="the job's last step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--fail-after", type=int, default=25)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    start = 0
    if os.path.exists(a.ckpt):
        state = torch.load(a.ckpt, weights_only=True)
        ddp.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start + 1, a.steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if step % a.save_every == 0:
            if rank == 0:
                state = {"model": ddp.state_dict(), "optimizer": opt.state_dict(), "step": step}
                torch.save(state, a.ckpt + ".tmp")
                os.replace(a.ckpt + ".tmp", a.ckpt)
            dist.barrier()
        if attempt == 0 and rank == 0 and step == a.fail_after:
            raise RuntimeError(f"injected failure after step {step}")
    torch.save({"weights": {k: v.detach() for k, v in ddp.state_dict().items()},
                "grads": [q.grad for q in ddp.parameters()]}, os.path.join(a.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
