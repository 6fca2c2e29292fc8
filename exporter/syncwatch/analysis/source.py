"""Where a command's data comes from: ``--prometheus URL --job NAME --start --end`` or ``--input FILE``."""

from __future__ import annotations

import math

from .. import cli
from . import recording
from .common import AnalysisError
from .prom import Prometheus
from .view import JobView, from_prometheus, parse_time

# the shortest window from Prometheus unless --window says otherwise: a recorded run's default
# is its own (MIN_WINDOW_STEPS steps), which a fixed number of seconds would override
PROMETHEUS_WINDOW = 15.0


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
    cli.add_flag(p, "--start", default="now-1h", help="range start: now, now-2h, unix seconds or RFC 3339")
    cli.add_flag(p, "--end", default="now", help="range end: now, now-5m, unix seconds or RFC 3339")
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
        raise AnalysisError(f"--window must be a positive number of seconds (got {args.window})")
    if args.input and args.prometheus:
        raise AnalysisError("give either --prometheus or --input, not both")
    if args.input:
        run = recording.load(args.input)
        if args.job and args.job != run.get("job"):
            raise AnalysisError(f"unknown train job {args.job!r}: {args.input} records {run.get('job')!r}")
        # a bound left at its default leaves the run's own edge: the default start (an hour ago)
        # taken along with a given --end would lie long after a run recorded earlier
        start = parse_time(args.start) if args.start != "now-1h" else None
        end = parse_time(args.end) if args.end != "now" else None
        return recording.to_view(run, args.input, start, end, args.window), run
    if not args.prometheus:
        raise AnalysisError("give --prometheus URL (with --job) or --input FILE")
    if not args.job:
        raise AnalysisError("--job (the train_job label) is required with --prometheus")
    start, end = parse_time(args.start), parse_time(args.end)
    window = PROMETHEUS_WINDOW if args.window is None else args.window
    return from_prometheus(prometheus_from_args(args), args.job, start, end, window), None


def prometheus_from_args(args) -> Prometheus:
    """The client the ``--prometheus*`` flags describe; credentials are read from their files."""
    if not (math.isfinite(args.prometheus_timeout) and args.prometheus_timeout > 0):
        raise AnalysisError(f"--prometheus-timeout must be a positive number of seconds "
                            f"(got {args.prometheus_timeout})")
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
