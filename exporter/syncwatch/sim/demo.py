"""``syncwatch demo``: a simulated cluster feeding real daemons, one per simulated node.

Starts one in-process daemon per node on ``--listen-host`` ports ``--base-port``, +1, ... (0 = any
free port), each with its own ingest socket in ``--socket-dir`` (a temporary directory by
default), runs the chosen scenario in real time, prints where to scrape and a summary line every
``--summary-every`` seconds until Ctrl-C, SIGTERM or SIGHUP (``kill``, a closed terminal), or
``--duration``; each stops the daemons and removes the temporary socket directory.
``--scenario scaling`` prints the model's step-CV-vs-nodes sweep beside the seed paper's table
instead (no daemons); with ``--ablations`` also the sweeps of the model with Gaussian jitter only
and with stalls but no congestion (the calibration table's comparison rows).
With ``--hardware`` (the default) every node's daemon also runs the real GPU, NIC and InfiniBand
collectors over that node's simulated hardware (``sim.hardware``): GPU temperature, clocks,
throttling and energy, and fabric traffic and congestion counters that follow the scenario.
``--send-to SOCKET`` starts no daemons and makes no socket directory: the simulated ranks send to
a daemon already running on that ingest socket, as training containers do (``docker compose
--profile demo up``, whose read-only container has no writable temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time

from ..cli import add_flag, named, plain
from ..protocol import LABEL_RE
from .driver import MAX_RANKS_PER_NODE, GroundTruth, node_name
from .model import ABLATIONS, Params, format_sweep, scaling_sweep
from .scenarios import SCENARIOS, ScenarioThread, scenario_params

NODE_PREFIX = "sim-node-"


def _mode(path: str) -> int:
    """``path``'s file mode, 0 where it does not exist (or cannot be looked at)."""
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


def _flag(parser, flag: str, **kw) -> None:
    """``add_flag`` with a SYNCWATCH_DEMO_* twin: ``SYNCWATCH_NODES`` or ``SYNCWATCH_DURATION`` set
    for another subcommand must not change the demo."""
    add_flag(parser, flag, env="SYNCWATCH_DEMO_" + flag.lstrip("-").replace("-", "_").upper(), **kw)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="run a simulated cluster against real daemons (one per simulated node)",
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _flag(p, "--scenario", choices=SCENARIOS + ("scaling",), default="straggler",
             help="what to simulate; 'scaling' prints the CV-vs-nodes sweep and exits")
    _flag(p, "--nodes", type=int, default=4, help="simulated nodes (one daemon each)")
    _flag(p, "--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node")
    _flag(p, "--base-port", type=int, default=9477,
             help="daemon of node n listens on base-port + n (0 = pick free ports)")
    _flag(p, "--listen-host", default="127.0.0.1", help="address the daemons listen on")
    _flag(p, "--socket-dir", default="", help="directory for the ingest sockets (empty = a temporary one)")
    _flag(p, "--send-to", default="",
          help="send every rank's records to this running daemon's ingest socket instead of "
               "starting daemons (empty = start one daemon per node)")
    _flag(p, "--duration", type=float, default=0.0,
          help="seconds to run (0 = until Ctrl-C, SIGTERM or SIGHUP)")
    _flag(p, "--step-time", type=float, default=0.5, help="mean compute time of one step, seconds")
    _flag(p, "--seed", type=int, default=0, help="random seed of the simulation")
    _flag(p, "--job", default="", help="train_job label (empty = sim-SCENARIO)")
    _flag(p, "--summary-every", type=float, default=5.0, help="seconds between summary lines")
    _flag(p, "--ablations", action="store_true",
          help="with --scenario scaling: also the sweeps with Gaussian jitter only and with "
               "stalls but no congestion")
    _flag(p, "--hardware", action=argparse.BooleanOptionalAction, default=True,
          help="give each simulated node fake GPUs and a RoCE NIC, driven by the simulation, and run "
               "the daemons' GPU, NIC and InfiniBand collectors over them (on unless --no-hardware)")
    p.set_defaults(func=main)


def summary(truth: GroundTruth, elapsed: float, window: int = 100) -> str:
    """One line: progress, step rate, CV, skew, and who arrived last most often lately."""
    n = min(window, len(truth.recent_step_seconds))
    if n == 0:
        return f"[{elapsed:6.1f}s] waiting for the first step"
    recent = list(truth.recent_step_seconds)[-n:]
    skews = list(truth.recent_skew)[-n:]
    rank, count = truth.top_straggler(last=n)
    R = truth.params.ranks_per_node
    return (f"[{elapsed:6.1f}s] step {truth.last_step} attempt {truth.attempt}  "
            f"{truth.executed_steps / max(elapsed, 1e-9):.2f} steps/s  "
            f"step {sum(recent) / n:.3f}s  CV {truth.cv(window):.3f}  "
            f"skew mean {sum(skews) / n * 1e3:.1f} ms max {max(skews) * 1e3:.1f} ms  "
            f"last arrival: rank {rank} ({node_name(NODE_PREFIX, rank // R)}) "
            f"{count / n:.0%} of the last {n} steps")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, frame) -> None:
    # once: a second SIGTERM (a supervisor's retry) must not cut the clean-up short
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_signals_interrupt():
    """Make SIGTERM and SIGHUP stop the demo as Ctrl-C does.

    Their default action kills the process without running ``finally``: the daemons' sockets and
    the temporary socket directory stayed behind. A demo started in the background
    (``syncwatch demo &``) is stopped with ``kill``, and a non-interactive shell starts it with
    SIGINT ignored, so Ctrl-C cannot reach it at all. Only the main thread may set handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args) -> int:
    if args.ranks_per_node < 1:  # before scaling's sweep, which uses it too
        print(f"syncwatch demo: {named(args, '--ranks-per-node')} must be at least 1",
              file=sys.stderr)
        return 2
    if args.scenario == "scaling":
        print("Step-time CV against cluster size (model only, 8 ranks per node unless "
              "--ranks-per-node), beside the seed paper's baseline:")
        print(format_sweep(scaling_sweep(ranks_per_node=args.ranks_per_node, seed=args.seed)))
        for title, changes in ABLATIONS.items() if args.ablations else ():
            print(f"\n{title}:")
            print(format_sweep(scaling_sweep(ranks_per_node=args.ranks_per_node, seed=args.seed,
                                             params=Params(**changes)), digits=4))
        return 0
    if args.ablations:
        print(f"syncwatch demo: {named(args, '--ablations')} goes with --scenario scaling",
              file=sys.stderr)
        return 2
    if args.ranks_per_node > MAX_RANKS_PER_NODE:
        print(f"syncwatch demo: {named(args, '--ranks-per-node')} must be at most "
              f"{MAX_RANKS_PER_NODE}: each simulated rank reports its local rank as its GPU "
              f"index, which the protocol bounds", file=sys.stderr)
        return 2
    if args.nodes < 1 or not 0 < args.step_time < math.inf:
        print(f"syncwatch demo: {named(args, '--nodes')} and {named(args, '--step-time')} must "
              f"be positive (and finite)", file=sys.stderr)
        return 2
    try:  # a step time the protocol refuses: every step record rejected, the truth counting it
        scenario_params(args.scenario, args.nodes, args.ranks_per_node,
                        compute_seconds=args.step_time)
    except ValueError as e:
        print(f"syncwatch demo: {named(args, '--step-time')} {args.step_time:g}: {e}",
              file=sys.stderr)
        return 2
    if not (0 <= args.duration < math.inf and 0 < args.summary_every < math.inf):
        print(f"syncwatch demo: {named(args, '--duration')} must be >= 0 and "
              f"{named(args, '--summary-every')} positive (finite)", file=sys.stderr)
        return 2
    if args.base_port and not (0 < args.base_port and args.base_port + args.nodes - 1 <= 65535):
        print(f"syncwatch demo: {named(args, '--base-port')} {args.base_port} with {args.nodes} "
              f"nodes needs ports {args.base_port}..{args.base_port + args.nodes - 1}: each must "
              f"be 1 to 65535 (or 0: any free port)", file=sys.stderr)
        return 2
    if args.job and not LABEL_RE.fullmatch(args.job):
        print(f"syncwatch demo: {named(args, '--job')} {args.job!r} is not a train_job label: "
              f"1 to 128 of A-Z a-z 0-9 _ . : @ / + = -", file=sys.stderr)
        return 2
    with _stop_signals_interrupt():
        return _run(args)


def _run(args) -> int:
    from ..daemon.app import DaemonThread
    from ..daemon.config import DaemonConfig

    # --send-to starts no daemon, so it makes no socket directory: the compose demo's read-only
    # container has no writable temporary directory
    own_dir = not (args.socket_dir or args.send_to)
    sock_dir = tempfile.mkdtemp(prefix="syncwatch-demo-") if own_dir else args.socket_dir
    daemons: list = []
    thread = hardware = None
    try:
        if args.hardware and not args.send_to:
            from .hardware import SimulatedHardware
            hardware = SimulatedHardware(args.nodes, args.ranks_per_node, NODE_PREFIX, period=0.5)
        for n in range(0 if args.send_to else args.nodes):
            port = args.base_port + n if args.base_port else 0
            config = DaemonConfig(listen=f"{args.listen_host}:{port}",
                                  socket=os.path.join(sock_dir, f"node{n:02d}.sock"))
            d = DaemonThread(config, extra_collectors=(hardware.nodes[n].collectors(1.0),) if hardware else ())
            try:
                d.start()
            except OSError as e:
                hint = ("try another --base-port, or 0" if e.errno == errno.EADDRINUSE
                        else "check --listen-host and --socket-dir")
                print(f"syncwatch demo: cannot start the daemon of node {n} on "
                      f"{config.listen}: {e} ({hint})", file=sys.stderr)
                return 2
            daemons.append(d)
        print(f"syncwatch demo: scenario {args.scenario}, {args.nodes} nodes x "
              f"{args.ranks_per_node} ranks, compute ~{args.step_time}s a step, seed {args.seed}"
              + (", simulated GPUs and RoCE NICs" if hardware else ""))
        for n, d in enumerate(daemons):
            print(f"  {node_name(NODE_PREFIX, n)}: scrape {d.url}/metrics  (ingest {d.socket_path})")
        if args.send_to:
            print(f"  every node sends to the daemon on {args.send_to}")
            if not stat.S_ISSOCK(_mode(args.send_to)):  # a warning: in compose the daemon may
                # create it a moment later; its summary lines are the simulator's own numbers
                print(f"syncwatch demo: warning: {args.send_to} is not a socket (yet): nothing "
                      "is received until a daemon listens there", file=sys.stderr)
        else:
            targets = ",".join(d.url.removeprefix("http://") for d in daemons)
            print(f"Prometheus and Alertmanager beside it: syncwatch stack up --targets {targets}")
        sockets = [args.send_to] * args.nodes if args.send_to else [d.socket_path for d in daemons]
        print("Ctrl-C stops." if not args.duration else f"Running for {args.duration:g} s.",
              flush=True)
        t0 = time.monotonic()  # before the thread exists: an interrupt's summary reads it
        thread = ScenarioThread(args.scenario, [{"socket": path} for path in sockets],
                                args.nodes, args.ranks_per_node, seed=args.seed,
                                job=args.job or None, params={"compute_seconds": args.step_time},
                                node_prefix=NODE_PREFIX)
        if hardware is not None:
            hardware.follow(thread.driver)
        thread.start()
        next_summary = args.summary_every
        while thread.is_alive():
            elapsed = time.monotonic() - t0
            if args.duration and elapsed >= args.duration:
                break
            if elapsed >= next_summary:
                print(summary(thread.truth, elapsed), flush=True)
                next_summary += args.summary_every
            time.sleep(0.1)
        if thread.error is not None:
            print(f"syncwatch demo: the simulation failed: {thread.error!r}", file=sys.stderr)
            return 1
        print(summary(thread.truth, time.monotonic() - t0), flush=True)
        return 0
    except KeyboardInterrupt:
        if thread is not None:
            print("\n" + summary(thread.truth, time.monotonic() - t0), flush=True)
        return 0
    finally:
        if thread is not None:
            thread.stop()
        for d in daemons:
            d.stop()
        if hardware is not None:
            hardware.close()
        if own_dir:
            shutil.rmtree(sock_dir, ignore_errors=True)
