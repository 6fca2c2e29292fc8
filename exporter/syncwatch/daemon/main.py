"""``syncwatch daemon``: run the node daemon until SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Sequence

from .. import collectors
from ..cli import add_flag, named
from .app import start_daemon
from .config import DaemonConfig

log = logging.getLogger("syncwatch.daemon")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("daemon", help="run the per-node daemon (ingest + /metrics)",
                              description="Receive rank records, keep bounded per-rank state and "
                                          "serve /metrics and /healthz.")
    d = DaemonConfig.__dataclass_fields__
    add_flag(p, "--listen", default=d["listen"].default,
             help="host:port for /metrics and /healthz (port 0 picks a free one)")
    add_flag(p, "--socket", default=d["socket"].default,
             help="Unix datagram ingest socket path (empty: off)")
    add_flag(p, "--udp", default="", help="also ingest UDP on this host:port, e.g. 127.0.0.1:9478 (empty: off)")
    add_flag(p, "--window", type=int, default=d["window"].default,
             help="rolling window W in steps for step CV and lag-1 autocorrelation")
    add_flag(p, "--cv-seconds", type=float, default=d["cv_seconds"].default,
             help="the step CV is over those of the last W steps that took at most this many "
                  "seconds together (at least 4 steps), so that one long step leaves it in time "
                  "for the variance alert not to page on it; inf: all W")
    add_flag(p, "--rank-ttl", type=float, default=d["rank_ttl"].default,
             help="seconds without any record before a rank is removed")
    add_flag(p, "--job-grace", type=float, default=d["job_grace"].default,
             help="seconds a job's series stay after its end record (a job whose ranks all expired "
                  "without one: after its last record)")
    add_flag(p, "--max-ranks", type=int, default=d["max_ranks"].default,
             help="most ranks tracked; records of further ranks are rejected (rank_limit)")
    add_flag(p, "--max-jobs", type=int, default=d["max_jobs"].default,
             help="most jobs tracked; records of further jobs are rejected (job_limit)")
    add_flag(p, "--log-level", default="info", help="debug, info, warning or error")
    collectors.add_flags(p)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    """The daemon's settings; a value its environment twin gave that ``DaemonConfig`` refuses
    is told with the twin's name (``--udp (from SYNCWATCH_UDP): udp must look like ...``): set
    in /etc/default/syncwatch or a pod spec, no flag of it is on the command line."""
    values = dict(listen=args.listen, socket=args.socket or None, udp=args.udp or None,
                  window=args.window, cv_seconds=args.cv_seconds, rank_ttl=args.rank_ttl,
                  job_grace=args.job_grace, max_ranks=args.max_ranks, max_jobs=args.max_jobs)
    for field, value in values.items():
        flag = "--" + field.replace("_", "-")
        if flag in getattr(args, "from_env", {}):
            try:  # the field's own checks, the others at their defaults
                DaemonConfig(**{"socket": None, field: value})
            except ValueError as e:
                raise ValueError(f"{named(args, flag)}: {e}") from None
    return DaemonConfig(**values)


async def serve(config: DaemonConfig, extra_collectors: Sequence = ()) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly."""
    daemon = await start_daemon(config, extra_collectors)
    log.info("syncwatch daemon: metrics on %s/metrics, ingest socket %s, udp %s", daemon.url,
             daemon.socket_path or "off", daemon.udp_address or "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("syncwatch daemon: stopping")
        await daemon.stop()


def run(args: argparse.Namespace) -> int:
    # The reader threads share the GIL with the render thread; a 1 ms switch interval (default
    # 5 ms) lets a reader woken by a datagram in sooner while a large scrape renders.
    sys.setswitchinterval(0.001)
    try:
        try:
            logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        except ValueError:  # logging's own words: "Unknown level: 'VERBOSE'"
            raise ValueError(f"{named(args, '--log-level')} must be debug, info, warning or error, "
                             f"got {args.log_level!r}") from None
        config = config_from_args(args)
        runner = collectors.runner_from_args(args)  # hardware collectors; None when all are off
        asyncio.run(serve(config, [runner] if runner else ()))
    except (OSError, ValueError) as e:
        print(f"syncwatch daemon: {e}", file=sys.stderr)
        return 2
    return 0
