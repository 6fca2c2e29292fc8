"""Where a command's data comes from: ``--prometheus URL --job NAME --start --end`` or ``--input FILE``."""

from __future__ import annotations

import math

from .. import cli
from . import recording
from .common import AnalysisError
from .prom import Prometheus
from .view import JobView, from_prometheus, parse_time


def add_source_flags(p) -> None:
    cli.add_flag(p, "--prometheus", default=None,
                 help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    cli.add_flag(p, "--job", default=None, help="train job (label train_job) to analyse")
    cli.add_flag(p, "--start", default="now-1h", help="range start: now, now-2h, unix seconds or RFC 3339")
    cli.add_flag(p, "--end", default="now", help="range end: now, now-5m, unix seconds or RFC 3339")
    cli.add_flag(p, "--window", type=float, default=15.0,
                 help="shortest analysis window, seconds (at least 2 scrape intervals)")
    cli.add_flag(p, "--input", default=None,
                 help="a recorded run (syncwatch-run/1 JSON) instead of Prometheus")
    cli.add_flag(p, "--json", action="store_true", help="print JSON instead of the summary")


def view_from_args(args) -> tuple[JobView, dict | None]:
    """The job view, and the recorded run itself when read from ``--input``."""
    if not (math.isfinite(args.window) and args.window > 0):
        raise AnalysisError(f"--window must be a positive number of seconds (got {args.window})")
    if args.input and args.prometheus:
        raise AnalysisError("give either --prometheus or --input, not both")
    if args.input:
        run = recording.load(args.input)
        if args.job and args.job != run.get("job"):
            raise AnalysisError(f"unknown train job {args.job!r}: {args.input} records {run.get('job')!r}")
        explicit = args.start != "now-1h" or args.end != "now"
        start = parse_time(args.start) if explicit else None
        end = parse_time(args.end) if explicit else None
        return recording.to_view(run, args.input, start, end), run
    if not args.prometheus:
        raise AnalysisError("give --prometheus URL (with --job) or --input FILE")
    if not args.job:
        raise AnalysisError("--job (the train_job label) is required with --prometheus")
    start, end = parse_time(args.start), parse_time(args.end)
    return from_prometheus(Prometheus(args.prometheus), args.job, start, end, args.window), None
