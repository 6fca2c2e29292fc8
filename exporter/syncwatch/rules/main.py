"""``syncwatch rules render``: write the rule files (optionally with every window scaled)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cli import add_flag
from .render import render, write
from .thresholds import RUNBOOK_BASE

REPO_ALERTS = Path(__file__).resolve().parents[3] / "alerts"
# the checkout's alerts/ where this runs from one; installed, ./alerts
DEFAULT_OUT = REPO_ALERTS if REPO_ALERTS.is_dir() else Path("alerts")


def register(subparsers) -> None:
    p = subparsers.add_parser("rules", help="render the Prometheus rule files")
    sub = p.add_subparsers(dest="rules_command", metavar="ACTION", required=True)
    r = sub.add_parser("render", help="write recording.rules.yml and <concern>.rules.yml")
    add_flag(r, "--out", type=Path, default=DEFAULT_OUT,
             help="directory to write the rule files into (default: the checkout's alerts/, "
                  "or ./alerts where syncwatch is installed from a wheel)")
    add_flag(r, "--time-scale", type=float, default=1.0,
             help="multiply every window and for: duration by this factor (tests use e.g. 0.05)")
    add_flag(r, "--runbook-base", default=RUNBOOK_BASE, help="URL of docs/runbook.md for runbook_url")
    add_flag(r, "--check", action="store_true",
             help="write nothing; exit 1 if the files in --out differ from the render")
    r.set_defaults(func=run_render)


def _render_command(args: argparse.Namespace) -> str:
    """The command that writes what ``--check`` compared against: its flags that are not defaults."""
    words = ["syncwatch", "rules", "render"]
    if args.out != DEFAULT_OUT:
        words += ["--out", str(args.out)]
    if args.time_scale != 1.0:
        words += ["--time-scale", f"{args.time_scale:g}"]
    if args.runbook_base != RUNBOOK_BASE:
        words += ["--runbook-base", args.runbook_base]
    return shlex.join(words)


def run_render(args: argparse.Namespace) -> int:
    try:
        if args.check:
            stale = [name for name, text in render(args.time_scale, args.runbook_base).items()
                     if not (args.out / name).is_file() or (args.out / name).read_text() != text]
            for name in stale:
                print(f"{args.out / name} is not current; run: {_render_command(args)}", file=sys.stderr)
            return 1 if stale else 0
        for path in write(args.out, args.time_scale, args.runbook_base):
            print(path)
    except ValueError as e:
        print(f"syncwatch rules render: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out a file, or not writable
        print(f"syncwatch rules render: cannot write into {args.out}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    return 0
