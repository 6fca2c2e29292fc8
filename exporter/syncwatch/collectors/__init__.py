"""Hardware collectors (GPU, NIC, InfiniBand/RoCE) and the runner that serves them to the daemon.

``add_flags(parser)`` adds the collector flags to a subcommand; ``runner_from_args(args)`` builds
the ``CollectorRunner`` the daemon takes as an extra collector. See docs/collectors.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import re

from ..cli import named
from . import gpu, infiniband, net  # noqa: F401 - importing registers the collectors
from .base import COLLECTORS, CollectorOptions, CollectorRunner, NoData, check_period, register

__all__ = ["COLLECTORS", "CollectorOptions", "CollectorRunner", "NoData", "register",
           "add_flags", "runner_from_args", "enabled_names"]


def _dest(name: str) -> str:
    return f"collector_{name}"


def regex(text: str) -> str:
    """argparse type: a regular expression that compiles."""
    try:
        re.compile(text)
    except re.error as e:
        raise ValueError(f"{text!r}: {e}") from None
    return text


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--collector.NAME`` / ``--no-collector.NAME`` for each registered collector, plus the
    schedule and the host path switches. Each flag has a SYNCWATCH_* twin (``cli.add_flag``)."""
    from ..cli import add_flag
    group = parser.add_argument_group("collectors")
    for spec in COLLECTORS.values():
        on = add_flag(group, f"--collector.{spec.name}", dest=_dest(spec.name), action="store_true",
                      default=spec.default,
                      help=f"Enable the {spec.name} collector: {spec.help} "
                           f"(default {'on' if spec.default else 'off'}).")
        group.add_argument(f"--no-collector.{spec.name}", dest=_dest(spec.name), action="store_false",
                           default=on.default, help=f"Disable the {spec.name} collector.")
    add_flag(group, "--collector.interval", dest="collector_interval", metavar="SECONDS", type=float, default=5.0,
             help="Seconds between two cycles of each collector.")
    add_flag(group, "--collector.timeout", dest="collector_timeout", metavar="SECONDS", type=float, default=2.0,
             help="Seconds after which a running collector call counts as failed (it is never "
                  "called again while stuck; its last snapshot is withdrawn after 3 intervals + timeout).")
    add_flag(group, "--path.sysfs", dest="path_sysfs", metavar="DIR", default="/sys", help="Where the host's sysfs is mounted.")
    add_flag(group, "--path.procfs", dest="path_procfs", metavar="DIR", default="/proc", help="Where the host's procfs is mounted.")
    add_flag(group, "--collector.net.exclude", dest="net_exclude", metavar="REGEX", type=regex,
             default=CollectorOptions.net_exclude,
             help="Regular expression of interface names the net collector skips ('' = none).")
    add_flag(group, "--collector.net.virtual", dest="net_virtual", action="store_true",
             default=CollectorOptions.net_virtual,
             help="Also collect virtual interfaces (bridges, veth, tunnels, bonds, VLANs: sysfs "
                  "entries under devices/virtual), whose carrier changes follow containers, not "
                  "links (default: physical NICs only).")


def enabled_names(args: argparse.Namespace) -> list[str]:
    return [name for name in COLLECTORS if getattr(args, _dest(name))]


SYSFS_COLLECTORS = ("net", "infiniband")  # read under --path.sysfs


def runner_from_args(args: argparse.Namespace) -> CollectorRunner | None:
    """The runner for the enabled collectors, or None when all are off.

    A ``--path.sysfs`` without ``class/`` under it is told once here: the collectors take a
    missing tree for hardware the node lacks (``NoData``: no series, success 1), so where the
    host's /sys is not mounted at the path given (``/host/sys`` in compose and Kubernetes) they
    would report nothing and nobody would learn why. A bad ``--collector.interval`` or
    ``--collector.timeout`` is told with its flag (and the variable that gave it)."""
    for flag, value in (("--collector.interval", args.collector_interval),
                        ("--collector.timeout", args.collector_timeout)):
        check_period(named(args, flag), value)
    options = CollectorOptions(sysfs=args.path_sysfs, procfs=args.path_procfs,
                               net_exclude=args.net_exclude, net_virtual=args.net_virtual)
    names = enabled_names(args)
    if not names:
        return None
    readers = [n for n in names if n in SYSFS_COLLECTORS]
    if readers and not os.path.isdir(os.path.join(options.sysfs, "class")):
        logging.getLogger("syncwatch.collectors").warning(
            "--path.sysfs %s has no class/ directory: the %s collector(s) will report nothing; "
            "mount the host's /sys there (read-only) or point --path.sysfs at it",
            options.sysfs, " and ".join(readers))
    return CollectorRunner({n: COLLECTORS[n].factory(options) for n in names},
                           interval=args.collector_interval, timeout=args.collector_timeout)
