"""Where a command's data comes from: ``--prometheus URL --job NAME --start --end`` or ``--input FILE``."""

from __future__ import annotations

import argparse
import math

from .. import cli
from . import recording
from .common import AnalysisError, tracked
from .prom import Prometheus
from .view import JobView, from_prometheus, fmt_time, parse_time

# the shortest window from Prometheus unless --window says otherwise: a recorded run's default
# is its own (MIN_WINDOW_STEPS steps), which a fixed number of seconds would override
PROMETHEUS_WINDOW = 15.0
DEFAULT_START, DEFAULT_END = "now-1h", "now"  # from Prometheus
_STORE = tracked(argparse._StoreAction)


def add_source_flags(p) -> None:
    cli.add_flag(p, "--prometheus", default=None,
                 help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    cli.add_flag(p, "--prometheus-timeout", type=float, default=30.0, metavar="SECONDS",
                 help="seconds to wait for each answer from Prometheus (long ranges over many ranks "
                      "may need more)")
    cli.add_flag(p, "--prometheus-bearer-token-file", default=None, metavar="FILE",
                 help="file holding a token sent as 'Authorization: Bearer' (Prometheus behind an "
                      "authenticating proxy)")
    cli.add_flag(p, "--prometheus-basic-auth-user", default=None, metavar="USER",
                 help="HTTP basic auth user name (with --prometheus-basic-auth-password-file)")
    cli.add_flag(p, "--prometheus-basic-auth-password-file", default=None, metavar="FILE",
                 help="file holding the HTTP basic auth password")
    cli.add_flag(p, "--job", default=None, help="train job (label train_job) to analyse")
    # no default here: a recorded run tells a bound given (as the flag or its twin) from one not given
    cli.add_flag(p, "--start", default=None, action=_STORE,
                 help=f"range start: now, now-2h, unix seconds or RFC 3339 (not given: {DEFAULT_START}; "
                      "a recorded run: its first step)")
    cli.add_flag(p, "--end", default=None, action=_STORE,
                 help=f"range end: now, now-5m, unix seconds or RFC 3339 (not given: {DEFAULT_END}; "
                      "a recorded run: its last step)")
    # not SYNCWATCH_WINDOW: that is the daemon's window in steps, and one exported for either
    # command would silently change the other
    cli.add_flag(p, "--window", type=float, default=None, env="SYNCWATCH_ANALYSIS_WINDOW",
                 help=f"shortest analysis window, seconds (from Prometheus: {PROMETHEUS_WINDOW:g} if not "
                      "given, raised to 2.5 of the job's scrape intervals and 4 of its skew-exchange "
                      f"periods; from a recorded run: {recording.MIN_WINDOW_STEPS} of its mean steps if "
                      "not given, and never fewer)")
    cli.add_flag(p, "--input", default=None,
                 help="a recorded run (syncwatch-run/1 JSON) instead of Prometheus")
    cli.add_flag(p, "--json", action="store_true", help="print JSON instead of the summary")


def view_from_args(args) -> tuple[JobView, dict | None]:
    """The job view, and the recorded run itself when read from ``--input``."""
    if args.window is not None and not (math.isfinite(args.window) and args.window > 0):
        raise AnalysisError(f"{cli.named(args, '--window')} must be a positive number of seconds "
                            f"(got {args.window})")
    if args.input and args.prometheus:
        raise AnalysisError(f"give either {cli.named(args, '--prometheus')} or "
                            f"{cli.named(args, '--input')}, not both")
    if args.input:
        run = recording.load(args.input)
        if args.job and args.job != run.get("job"):
            raise AnalysisError(f"unknown train job {args.job!r}: {args.input} records {run.get('job')!r}")
        # a bound not given leaves the run's own edge: the default start (an hour ago) taken along
        # with a given --end would lie long after a run recorded earlier. One given, as the flag
        # or its twin, applies as given, "now-1h" too (that value read as not given)
        start = parse_time(args.start) if args.start is not None else None
        end = parse_time(args.end) if args.end is not None else None
        if not recording.select(run, start, end):
            raise AnalysisError(_empty_recording(args, run, start, end))
        return recording.to_view(run, args.input, start, end, args.window), run
    if not args.prometheus:
        raise AnalysisError("give --prometheus URL (with --job) or --input FILE")
    if not args.job:
        raise AnalysisError("--job (the train_job label) is required with --prometheus")
    start = parse_time(DEFAULT_START if args.start is None else args.start)
    end = parse_time(DEFAULT_END if args.end is None else args.end)
    window = PROMETHEUS_WINDOW if args.window is None else args.window
    return from_prometheus(prometheus_from_args(args), args.job, start, end, window), None


def _empty_recording(args, run: dict, start: float | None, end: float | None) -> str:
    """Why no step of a recorded run is in range: the bounds as given (flag or environment twin,
    which a user may have exported for Prometheus and forgotten) and when the run's steps ended."""
    def bound(name: str, t: float | None, edge: str) -> str:
        value = getattr(args, name)
        if value is None:
            return f"the run's {edge} step"
        given = (f"--{name} {value}" if name in getattr(args, "_given", ()) else
                 f"{cli.env_name('--' + name)}={value}")
        return f"{fmt_time(t)} ({given})"

    ends = [s["t"] + s["seconds"] for s in run["steps"]]
    held = (f"its steps end between {fmt_time(ends[0])} and {fmt_time(ends[-1])}" if ends
            else "it holds no step")
    relative = any(v is not None and str(v).strip().startswith("now") for v in (args.start, args.end))
    hint = "; a time relative to now counts from now, not from the recording" if relative and ends else ""
    return (f"{args.input}: no step of {run.get('job')!r} ends between {bound('start', start, 'first')} and "
            f"{bound('end', end, 'last')} (empty range): {held}{hint}")


def prometheus_from_args(args) -> Prometheus:
    """The client the ``--prometheus*`` flags describe; credentials are read from their files."""
    if not (math.isfinite(args.prometheus_timeout) and args.prometheus_timeout > 0):
        raise AnalysisError(f"{cli.named(args, '--prometheus-timeout')} must be a positive number "
                            f"of seconds (got {args.prometheus_timeout})")
    # an environment twin set to "" counts as not given
    token_file = args.prometheus_bearer_token_file or None
    user, password_file = args.prometheus_basic_auth_user or None, args.prometheus_basic_auth_password_file or None
    if (user is None) != (password_file is None):
        raise AnalysisError("--prometheus-basic-auth-user and --prometheus-basic-auth-password-file "
                            "go together")
    if user is not None and token_file is not None:
        raise AnalysisError("give either --prometheus-bearer-token-file or basic auth, not both")
    token = _secret("--prometheus-bearer-token-file", token_file) if token_file else None
    basic = (user, _secret("--prometheus-basic-auth-password-file", password_file)) if user else None
    return Prometheus(args.prometheus, args.prometheus_timeout, bearer_token=token, basic_auth=basic)


def _secret(flag: str, path: str) -> str:
    """A token or password from a file, surrounding whitespace (the file's last newline) removed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise AnalysisError(f"cannot read {flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text:
        raise AnalysisError(f"{flag} {path} is empty")
    return text
