"""End-to-end overhead of the instrumentation on a 4-rank CPU DDP loop, and the skew exchange.

    python benchmarks/instrument_ddp_overhead.py [--world 4] [--pairs 150] [--block-steps 10] \
        [--arm full|auto|noop|same|hook-only|calls-only] [--wrap ddp|fully_shard] [--dump FILE]

Same processes, same run: every rank holds two identical DDP models, one plain (DDP's built-in
all-reduce, no syncwatch calls) and one "instrumented" (``--arm full``: ``register``, i.e. the
hook-free gradient wait and the collective wrappers, six phases, ``step``, exact skew exchange
every K = 50 steps; ``--arm auto``: the plain step's code, instrumented the way ``syncwatch-run``
does it (DDP's patched ``forward``, optimizer hooks), with the same gradient wait, wrappers and
exchange; ``--arm noop``: the same calls with nothing initialized; ``--arm same``: the plain
step in both blocks, the A/A check that shows the method's own noise floor; the other arms
split syncwatch into its parts). The two models swap roles every ``--swap`` pairs, so that a
difference between the two instances themselves (memory
placement: ~1 % in an A/A run without swapping) cancels. ``--wrap fully_shard``: the same
with FSDP2 models (``fully_shard`` on each layer and the whole model), whose waits are the
wrapped collectives; the wrappers are global, so they are installed just before each
instrumented block and removed after it, outside the timing (arms full, hook-only, calls-only,
noop, same).

Method, and why. On a shared 2-core VM running 4 ranks, the wall time of a block of steps
drifts by several percent with other jobs, so a total wall ratio cannot resolve 0.5 %. So:

* Many short blocks (``--block-steps`` steps, default 10), in ``--pairs`` pairs; each pair runs
  one plain and one instrumented block back to back, in an order drawn at random per pair (the
  same draw on every rank: the models' all-reduces must match), so slow drifts and any
  first/second-in-pair bias cancel. Every block starts after a barrier.
* The records thread replays, encodes and sends on a timer, so its work would land in plain
  and instrumented blocks alike and cancel out of the difference. Each instrumented block
  therefore ends with ``flush()`` inside its timing: the work for the block's steps is charged
  to it (on the training thread, a conservative stand-in for the records thread's CPU and
  interpreter lock). Ten ~23 ms steps make a block of ~0.2 s, the records thread's own period,
  so the charged flush pays its cold start as often as the records thread does (4-step blocks
  paid it 2.5 times as often: 35-46 against 19-20 us of records work per step). Records go
  to an absent daemon: the send fails fast (a real one is a ~2 us syscall, and the daemon's own
  work is not the rank's).
* Three figures per block: wall time (``perf_counter``), the training thread's CPU time
  (``thread_time``: forward, backward compute, optimizer and all syncwatch calls on that
  thread; it excludes gloo's threads and time spent waiting, so other jobs on the machine
  disturb it far less than wall time) and the whole process's CPU time (``process_time``:
  adds gloo's threads and syncwatch's exchange and records threads; an exchange still
  running when its block ends is charged to the next block, whichever arm).
* Per pair the difference instrumented - plain; reported: its mean over all ranks' pairs, per
  step and as a fraction of the plain step, with a 95 % bootstrap interval (pairs resampled,
  2000 times). The ``same`` arm run the same way gives the method's noise floor: an effect is
  resolved only where the ``full`` interval clears it.

Rank 0 also prints the exchange's latency (in its own thread) and the training thread's step
time with and without an exchange in flight.
"""

import argparse
import json
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
    from syncwatch.instrument import auto
    from syncwatch.instrument.notes import Notes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(a.hidden, a.hidden), nn.ReLU(),
                              nn.Linear(a.hidden, a.hidden))
        if fsdp:
            for layer in (model[0], model[2], model):
                fully_shard(layer)
        else:
            model = DDP(model)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)
    fsdp = a.wrap == "fully_shard"
    if fsdp:
        if a.arm == "auto":
            sys.exit("--arm auto is DDP's zero-code mode: not with --wrap fully_shard")
        from torch.distributed.fsdp import fully_shard
    models = make(), make()
    m = sw.init(exchange_every=a.k if a.arm in ("full", "auto") else 0, job="bench")
    watch = a.arm in ("full", "auto", "hook-only")
    if watch and not fsdp:
        sw.register(collectives=True)
    wrappers = []  # FSDP: the collective wrappers, installed for each instrumented block
    if a.arm not in ("full", "auto", "hook-only", "calls-only"):
        sw.shutdown()
    steps = None
    if a.arm == "auto":  # DDP's forward patched as syncwatch-run does, after the models are
        # built (its __init__ would attach both); see swap_roles()
        steps = auto._Steps(m, torch.is_grad_enabled)
        auto._patch_ddp_module(sys.modules[DDP.__module__])
    phase, end_step = sw.phase, sw.step
    if a.arm == "hook-only":
        idle = Notes(0, time.time)  # never bound: the same calls, noting nothing
        phase, end_step = (lambda name, p=idle.phase(0, 0): p), idle.step
    x = torch.randn(a.batch, a.hidden)
    y = torch.randn(a.batch, a.hidden)
    step_times = {"plain": {True: [], False: []}, "inst": {True: [], False: []}}

    def in_flight():  # a skew exchange runs meanwhile
        return m.exchange.in_flight() if m is not None and m.exchange else False

    def plain_step(model, opt, label="plain"):
        busy, t0 = in_flight(), time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_times[label][busy].append(time.perf_counter() - t0)

    def explicit_step(model, opt):
        busy, t0 = in_flight(), time.perf_counter()
        with phase("data"):
            pass
        with phase("forward"):
            loss = nn.functional.mse_loss(model(x), y)
        with phase("backward"):
            opt.zero_grad()
            loss.backward()
        with phase("optimizer"):
            opt.step()
        with phase("checkpoint"):
            pass
        with phase("eval"):
            pass
        end_step(a.batch)
        step_times["inst"][busy].append(time.perf_counter() - t0)

    # zero-code mode: the hooks do it all, so the instrumented block runs the plain code
    inst_step = (lambda model, opt: plain_step(model, opt, "inst")) if a.arm == "auto" \
        else explicit_step

    role, handles = 0, []  # models[role] is the instrumented one

    def swap_roles():
        nonlocal role
        role = 1 - role
        while handles:
            handles.pop().remove()
        model, opt = models[role]
        if watch and not fsdp:
            handles.append(sw.register(model, collectives=False))
        if steps is not None:  # what auto._attach adds, with the optimizer hooks on this
            steps.optimizer = auto.nobody  # model's optimizer (_attach: global hooks)
            models[1 - role][0].__dict__.pop(auto.ATTACHED, None)
            model.__dict__[auto.ATTACHED] = steps
            handles.extend((opt.register_step_pre_hook(steps.optimizer_pre),
                            opt.register_step_post_hook(steps.optimizer_post)))

    swap_roles()
    for _ in range(5):  # warm-up (DDP rebuilds buckets after the first iteration)
        for r in (0, 1):
            swap_roles()
            inst_step(*models[role])
            plain_step(*models[1 - role])
    # charge the records work
    live = a.arm in ("full", "auto", "hook-only", "calls-only") and not a.uncharged
    flushed = []  # training-thread CPU of each instrumented block's closing flush()
    rng = random.Random(a.seed)  # the same order on every rank
    clocks = (time.perf_counter, time.thread_time, time.process_time)
    pairs = []  # per pair: (plain, instrumented) block time for each clock
    for i in range(a.pairs):
        if i % a.swap == 0:
            swap_roles()
        spent = {}
        for arm in rng.sample(("plain", "inst"), 2):
            fn, model = (inst_step, models[role]) if arm == "inst" else (plain_step, models[1 - role])
            if a.arm == "same":
                fn = plain_step  # the A/A check: the very same code in both blocks
            if fsdp and watch and arm == "inst":
                wrappers.append(sw.register(collectives=True))
            dist.barrier()
            t0 = [c() for c in clocks]
            for _ in range(a.block_steps):
                fn(*model)
            if arm == "inst" and live:  # the records thread's work for this block, charged to it
                f0 = time.thread_time()
                m.flush()
                flushed.append(time.thread_time() - f0)
            spent[arm] = [c() - t for c, t in zip(clocks, t0)]
            while wrappers:
                wrappers.pop().remove()
        pairs.append(tuple(zip(spent["plain"], spent["inst"])))
    if steps is not None and m.last_step < a.pairs * a.block_steps:
        sys.exit(f"zero-code mode ended {m.last_step} steps, not {a.pairs * a.block_steps}")
    ex = m.exchange
    if ex:
        ex.drain(5)
    elif a.arm != "full":
        ex = None
    # as a tensor: all_gather_object needs numpy, which torch does not install
    mine = torch.tensor(pairs, dtype=torch.float64)  # pairs x clocks x (plain, inst)
    tensors = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors, mine)
    gathered = [t.tolist() for t in tensors]
    if rank == 0 and a.dump:
        with open(a.dump, "w") as f:
            json.dump({"clocks": ["wall", "thread", "process"], "block_steps": a.block_steps,
                       "ranks": gathered}, f)
    if rank == 0:
        n = a.pairs * a.block_steps
        print(f"arm {a.arm}, {a.wrap}, world {dist.get_world_size()}, hidden {a.hidden}, batch {a.batch}, "
              f"{n} steps per arm in {a.pairs} pairs of {a.block_steps}-step blocks, "
              f"load average {os.getloadavg()[0]:.1f}")
        rng = random.Random(1)
        for k, label in enumerate(("wall", "training-thread CPU", "process CPU")):
            plain, diff, lo, hi = overhead(gathered, k, rng)
            print(f"{label:20s} plain {plain / a.block_steps * 1e3:7.3f} ms/step, instrumented "
                  f"{diff / a.block_steps * 1e6:+7.1f} us/step = {diff / plain * 100:+.2f} % "
                  f"(95 % bootstrap {lo / plain * 100:+.2f} .. {hi / plain * 100:+.2f} %)")
        if flushed:
            print(f"records work (replay, encoding, send), charged above: "
                  f"{sum(flushed) / (len(flushed) * a.block_steps) * 1e6:.1f} us CPU per step on rank 0")
        if ex: print(f"skew exchange (K={a.k}): {ex.windows_done} windows, "
              f"{ex.seconds / max(ex.windows_done, 1) * 1e3:.2f} ms each in its own thread, "
              f"payload 2 x {8 * (a.k + 1)} bytes per rank (K waits and the median step time)")
        for arm in ("plain", "inst"):
            busy, idle = step_times[arm][True], step_times[arm][False]
            if busy:
                print(f"rank 0 {arm} step time with an exchange in flight: "
                      f"{statistics.median(busy) * 1e3:.3f} ms median over {len(busy)} steps; "
                      f"without: {statistics.median(idle) * 1e3:.3f} ms over {len(idle)} steps")
    sw.shutdown()
    dist.destroy_process_group()


def overhead(gathered, k, rng, resamples: int = 2000):
    """Clock ``k``: the mean plain block time, the mean instrumented - plain difference over all
    ranks' pairs, and a 95 % bootstrap interval of that mean (pairs resampled together across
    ranks: a pair is one moment of the run, shared by all ranks)."""
    moments = list(zip(*gathered))  # per pair index: every rank's (plain, inst) per clock

    def mean_diff(sample):
        d = [r[k][1] - r[k][0] for moment in sample for r in moment]
        return sum(d) / len(d)
    plain = statistics.mean(r[k][0] for moment in moments for r in moment)
    means = sorted(mean_diff(rng.choices(moments, k=len(moments))) for _ in range(resamples))
    return plain, mean_diff(moments), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--block-steps", type=int, default=10,
                   help="steps per block; one charged flush per block (default 10: ~0.2 s, the "
                        "records thread's period, at this model's ~23 ms steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", metavar="FILE",
                   help="write every rank's block times (pairs x clocks x (plain, inst)) as JSON")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--swap", type=int, default=10,
                   help="pairs between swaps of the two models' roles (instrumented / plain)")
    p.add_argument("--arm", choices=("full", "auto", "hook-only", "calls-only", "noop", "same"),
                   default="full",
                   help="what the instrumented model gets: syncwatch (full), the API calls with "
                        "nothing initialized (noop), or nothing (same: A/A check of the method); "
                        "auto: zero-code mode's hooks on the plain step's code; "
                        "hook-only / calls-only split syncwatch into its gradient-wait "
                        "measurement and its phase/step calls")
    p.add_argument("--wrap", choices=("ddp", "fully_shard"), default="ddp",
                   help="the models: DDP, or FSDP2 (fully_shard on each layer and the model)")
    p.add_argument("--uncharged", action="store_true",
                   help="leave the records thread's work to its timer, where it lands in both "
                        "arms and cancels out of the difference (the method before charging it)")
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
