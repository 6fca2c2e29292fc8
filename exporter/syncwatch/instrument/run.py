"""``syncwatch-run <command...>``: run an unmodified PyTorch command with instrumentation.

    syncwatch-run torchrun --nproc-per-node 4 train.py --epochs 3

Instruments the DDP and FSDP (``FullyShardedDataParallel``, ``fully_shard``) models the program
builds: steps, phases, samples, sync waits, collectives, heartbeats (docs/instrumentation.md).
Puts a ``sitecustomize`` on ``PYTHONPATH`` (see ``syncwatch.instrument.auto``) and replaces
itself with the command, so signals and the exit status are the command's own. Options become
``SYNCWATCH_*`` variables that every rank reads. Its own errors, in one line: exit 2 for bad
options or no command, 127 for a command not found, 126 for one that cannot be executed.

Only the ``sitecustomize``'s own directory goes on ``PYTHONPATH``, never the directory syncwatch
is installed in: that is a whole ``site-packages``, which ahead of the program's would shadow its
packages and even the standard library (an old ``pathlib`` or ``asyncio`` from PyPI). Where the
program's environment has no syncwatch, the ``sitecustomize`` loads this one from
``SYNCWATCH_PACKAGE_ROOT`` alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..cli import Parser, add_flag as _add_flag, named, plain
from ..sender import DEFAULT_SOCKET, check_unix_path, parse_udp
from ..skew import EXCHANGE_SECONDS
from . import DEFAULT_EXCHANGE_EVERY, DEFAULT_HEARTBEAT_SECONDS

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
# the directory syncwatch is imported from here: the ranks' fallback (SYNCWATCH_PACKAGE_ROOT)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# flag -> environment variable the ranks read
_ENV = {"socket": "SYNCWATCH_SOCKET", "udp": "SYNCWATCH_UDP", "job": "SYNCWATCH_JOB",
        "skew_every": "SYNCWATCH_SKEW_EVERY", "skew_seconds": "SYNCWATCH_SKEW_SECONDS",
        "heartbeat": "SYNCWATCH_HEARTBEAT"}


def add_flag(parser, flag: str, **kw) -> argparse.Action:
    """``cli.add_flag``, where an empty twin is unset, as the ranks read it (``export
    SYNCWATCH_UDP=``: refused here, the default there)."""
    return _add_flag(parser, flag, empty_unset=True, **kw)


class _Transport(argparse.Action):
    """``--socket`` or ``--udp``, noting which was given: it wins over both variables."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.transport = self.dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    transport = parser.add_mutually_exclusive_group()
    add_flag(transport, "--socket", default=None, action=_Transport,
             help=f"daemon's Unix datagram ingest socket, used even where SYNCWATCH_UDP is "
                  f"set (default {DEFAULT_SOCKET})")
    add_flag(transport, "--udp", default=None, action=_Transport,
             help="send to the daemon over UDP HOST:PORT instead")
    add_flag(parser, "--job", default=None, help="train_job label (default: launcher's job id)")
    add_flag(parser, "--skew-every", type=int, default=None,
             help=f"exact skew exchange every K steps (0 = off; default {DEFAULT_EXCHANGE_EVERY})")
    add_flag(parser, "--skew-seconds", type=float, default=None,
             help=f"where K steps take longer, exchange every this many seconds' steps instead "
                  f"(0 or inf = always K; default {EXCHANGE_SECONDS:g})")
    add_flag(parser, "--heartbeat", type=float, default=None,
             help=f"heartbeat interval, seconds (default {DEFAULT_HEARTBEAT_SECONDS:g})")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command, e.g. torchrun --nproc-per-node 4 train.py")


def _udp(args) -> str | None:
    """The UDP address the ranks will send to: none where ``--socket`` was given (the ranks take
    ``SYNCWATCH_UDP`` first, and an inherited one silently won over the flag)."""
    return None if getattr(args, "transport", None) == "socket" else args.udp


def child_env(args, environ=None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    for attr, var in _ENV.items():
        value = _udp(args) if attr == "udp" else getattr(args, attr)
        if value is not None:
            env[var] = str(value)
    if _udp(args) is None:
        env.pop("SYNCWATCH_UDP", None)
    # the user's entries as they are: an empty one is the current directory (``:/x``, from
    # ``PYTHONPATH=$PYTHONPATH:/x``); only an empty PYTHONPATH has none
    user = env.get("PYTHONPATH") or ""
    mine = [p for p in user.split(os.pathsep) if p != SITE_DIR] if user else []
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *mine])
    env["SYNCWATCH_PACKAGE_ROOT"] = PACKAGE_ROOT
    return env


def _bad_option(args) -> str | None:
    """What is wrong with the options, checked before the command runs: every rank would
    otherwise print a traceback and train unmonitored (a bad ``--udp``), drop every record (a
    ``--socket`` path too long for a Unix socket), or quietly run without heartbeats or the
    exchange (a heartbeat of 0, a negative K). A value from a variable is told with its name."""
    if args.socket and not _udp(args):  # the ranks send over UDP where it is set
        try:
            check_unix_path(args.socket)
        except ValueError as e:
            return f"{named(args, '--socket')}: {e}"
    if _udp(args) is not None:
        try:
            parse_udp(args.udp)
        except ValueError as e:
            return f"{named(args, '--udp')}: {e}"
    if args.heartbeat is not None and not (math.isfinite(args.heartbeat) and args.heartbeat > 0):
        return (f"{named(args, '--heartbeat')} must be a positive number of seconds, "
                f"got {args.heartbeat:g}")
    if args.skew_every is not None and args.skew_every < 0:
        return (f"{named(args, '--skew-every')} must be 0 (off) or a number of steps, "
                f"got {args.skew_every}")
    # not NaN, not negative; inf keeps windows of K, as the ranks read SYNCWATCH_SKEW_SECONDS=inf
    if args.skew_seconds is not None and not args.skew_seconds >= 0:
        return (f"{named(args, '--skew-seconds')} must be 0, a positive number or inf, "
                f"got {args.skew_seconds:g}")
    return None


def run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("syncwatch-run: no command given (e.g. syncwatch-run torchrun train.py)",
              file=sys.stderr)
        return 2
    bad = _bad_option(args)
    if bad:
        print(f"syncwatch-run: {bad}", file=sys.stderr)
        return 2
    try:
        os.execvpe(command[0], command, child_env(args))
    except OSError as e:
        print(f"syncwatch-run: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        # as the shell and env(1) say it: 127 not found, 126 found but not executable
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an unmodified PyTorch command, instrumented",
                              description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="syncwatch-run", description=plain(__doc__),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
