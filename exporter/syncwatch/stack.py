"""Run real Prometheus and Alertmanager as subprocesses on loopback (tests, demo, local use).

    with Prometheus(targets=["127.0.0.1:9477"], rule_files=[...]) as prom:
        wait_until(lambda: prom.query("up"), 30, what="a first scrape")

Each server gets a generated config (Alertmanager given a file runs on that file where it lies),
a private temporary directory for its storage, and a free loopback port (Prometheus and
Alertmanager cannot report a port-0 bind, so a free port is picked first and the start retried
if another process takes it meanwhile). ``stop()`` terminates the
process and removes the directory. Queries go through the HTTP API with ``syncwatch.promapi``.

``syncwatch stack up`` runs both next to the demo or a real daemon until Ctrl-C.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Sequence

import yaml

from . import promapi
from .cli import add_flag, named

REPO = Path(__file__).resolve().parents[2]


def installed_data() -> list[Path]:
    """Where pip put the package's data files (``share/syncwatch``, pyproject.toml's data-files):
    the ``data`` directory of the install scheme whose library directory holds this package,
    whatever its prefix: a venv; ``/usr/local`` for Debian's system pip, while ``sys.prefix`` is
    ``/usr``; ``~/.local`` or ``$PYTHONUSERBASE`` for ``pip install --user``; ``--prefix DIR``.
    ``<sys.prefix>/share/syncwatch`` last."""
    package_parent = Path(__file__).absolute().parents[1]
    found = []
    for scheme in sysconfig.get_scheme_names():
        paths = sysconfig.get_paths(scheme)
        for lib in (paths["purelib"], paths["platlib"]):
            try:
                layout = Path(lib).relative_to(paths["data"]).parts
            except ValueError:
                continue
            if layout and package_parent.parts[-len(layout):] == layout:
                found.append(package_parent.parents[len(layout) - 1] / "share" / "syncwatch")
    return list(dict.fromkeys(found + [Path(sys.prefix) / "share" / "syncwatch"]))


def shipped(relative: str) -> Path:
    """A file of the checkout (``deploy/…``, ``alerts``) that the stack runs from: the checkout's
    where there is one (a source tree, an editable install), else the installed copy
    (``installed_data``)."""
    installed = installed_data()
    for base in (REPO, *installed):
        if (base / relative).exists():
            return base / relative
    raise StackError(f"{relative} is in neither a syncwatch checkout ({REPO}) nor the installed "
                     f"package's data ({', '.join(map(str, installed))}): reinstall syncwatch, "
                     "or run from a checkout")


PROMETHEUS_BINARIES = ("prometheus",)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")  # Debian name first


class StackError(RuntimeError):
    """A server could not be found, started or queried."""


def find_binary(names: Iterable[str], package: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise StackError(f"none of {', '.join(names)} found on PATH (Debian package: {package})")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.25,
               what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; raise ``TimeoutError`` with ``what``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, StackError, ValueError) as e:
            last_error = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}"
                               + (f" (last error: {last_error})" if last_error else ""))
        time.sleep(interval)


# set by a stop signal while ``stack up`` runs (``_stop_on_signals``): a server starting gives up
_stopping = [False]


class _Server:
    """A server process on a free loopback port with a work directory (``workdir``, created if
    missing, or a private temporary one removed on ``stop()``) holding its YAML ``config`` (a
    dict; ``Alertmanager`` also runs a file where it lies)."""

    name = "server"
    ready_path = "/-/ready"

    def __init__(self, binary: str, config: dict | Path, workdir: str | None = None,
                 log_to: str | None = None):
        self.binary = binary
        self.config = config
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"sw-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{self.name}.yml"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(log_to) if log_to else self.workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        raise NotImplementedError

    def _write_config(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def start(self, timeout: float = 30.0, port: int = 0) -> "_Server":
        """Start and wait until ready. ``port=0`` picks a free one (retried on a lost race)."""
        self._write_config()
        if port:  # a server already there would answer the readiness probe in this one's place
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError as e:
                    raise StackError(f"{self.name} did not start: 127.0.0.1:{port}: {e.strerror.lower()} "
                                     f"(another port, or 0 for a free one)") from None
        for attempt in range(3):
            self.port = port or free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([self.binary, *self._args()], stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            deadline = time.monotonic() + timeout
            try:
                while self.proc.poll() is None and time.monotonic() < deadline:
                    if _stopping[0]:
                        raise KeyboardInterrupt
                    if self._ready():
                        return self
                    time.sleep(0.2)
            except BaseException:
                # Ctrl-C while it starts: the caller does not hold it yet, and in its own session
                # it would outlive us
                self._kill()
                raise
            code = self.proc.poll()
            self._kill()
            if code is None or port or attempt == 2:  # only an early exit on a picked port is retried
                why = f"within {timeout:g}s" if code is None else f"(it exited with code {code})"
                raise StackError(f"{self.name} did not start {why}; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        # HTTPException: something else that is not HTTP holds the port (as when a taken
        # --prometheus-port makes our server exit); wait for that exit and report it
        try:
            http_get(self.url + self.ready_path, timeout=2)
            return True
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Prometheus(_Server):
    """Prometheus scraping ``targets`` (job ``syncwatch``) with optional rules and Alertmanager."""

    name = "prometheus"

    def __init__(self, targets: Sequence[str] = (), *, scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", rule_files: Sequence[str | Path] = (),
                 alertmanager_url: str | None = None, scrape_job: str = "syncwatch",
                 extra_scrape_configs: Sequence[dict] = (), resend_delay: str = "1m",
                 binary: str | None = None, workdir: str | None = None, log_to: str | None = None):
        """``resend_delay``: how often a firing alert is re-sent to Alertmanager; an alert firing
        before Alertmanager is discovered (the first seconds) is only delivered at its next resend,
        so tests use a short one."""
        self.resend_delay = resend_delay
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": scrape_job, "scrape_interval": scrape_interval,
                                "static_configs": [{"targets": list(targets)}]},
                               *extra_scrape_configs],
        }
        if alertmanager_url:
            hostport = urllib.parse.urlsplit(alertmanager_url).netloc
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [hostport]}]}]}
        super().__init__(binary or find_binary(PROMETHEUS_BINARIES, "prometheus"), config, workdir, log_to)

    def _args(self) -> list[str]:
        return [f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
                f"--rules.alert.resend-delay={self.resend_delay}", "--log.level=warn"]

    # --- HTTP API, through syncwatch.promapi
    @property
    def client(self) -> promapi.Client:
        return promapi.Client(self.url, timeout=10)

    def api(self, path: str, **params) -> object:
        """The ``data`` of ``/api/v1/<path>``; every failure is a ``StackError`` saying why."""
        try:
            return self.client.api(path, **params)
        except promapi.PrometheusError as e:
            raise StackError(str(e)) from None

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        """Instant query: a list of ``{"metric": {...}, "value": [ts, "v"]}``."""
        return self.api("query", query=expr, time=time)["result"]

    def value(self, expr: str, time: float | None = None) -> float | None:
        """The value of a single-sample query, or None when it returns nothing."""
        res = self.query(expr, time)
        if len(res) > 1:
            raise StackError(f"{expr!r} returned {len(res)} series, expected at most one")
        return float(res[0]["value"][1]) if res else None

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def alerts(self) -> list[dict]:
        """Active (pending and firing) alerts as Prometheus sees them."""
        return self.api("alerts")["alerts"]

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def reload(self) -> None:
        """Rewrite the configuration and have the running server load it."""
        self._write_config()
        try:
            self.client.request("/-/reload", form={})
        except promapi.PrometheusError as e:
            raise StackError(str(e)) from None


class Alertmanager(_Server):
    """Alertmanager with ``config`` (a dict or a YAML file path), gossip off.

    A file is run as it is, not copied: PyYAML reads the YAML 1.1 that Alertmanager's parser does
    not (a time interval's ``end_time: 17:00`` is the sexagesimal 1020, which Alertmanager then
    refused: "couldn't parse timestamp 1020"), and Alertmanager resolves a relative ``templates``
    or ``*_file`` path against the directory of the file it is given."""

    name = "alertmanager"

    def __init__(self, config: dict | str | Path, *, binary: str | None = None,
                 workdir: str | None = None, log_to: str | None = None):
        if not isinstance(config, dict):
            config = Path(config).resolve(strict=True)  # missing: FileNotFoundError, naming it
        super().__init__(binary or find_binary(ALERTMANAGER_BINARIES, "prometheus-alertmanager"),
                         config, workdir, log_to)
        if isinstance(config, Path):
            self.config_path = config

    def _write_config(self) -> None:
        if isinstance(self.config, dict):
            super()._write_config()

    def _args(self) -> list[str]:
        return [f"--config.file={self.config_path}", f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                "--log.level=warn"]

    def alerts(self) -> list[dict]:
        return json.loads(http_get(f"{self.url}/api/v2/alerts", timeout=10))


def alertmanager_config_for_test(base: dict, webhook_url: str, *, group_wait: str = "1s",
                                 group_interval: str = "2s", repeat_interval: str = "1h") -> dict:
    """The shipped routing with every webhook pointed at ``webhook_url/<receiver>`` and fast timers.

    Routes, grouping and inhibition stay as shipped, so a test exercises the real routing tree.
    """
    cfg = json.loads(json.dumps(base))  # deep copy

    def fast(route: dict) -> None:
        for key, value in (("group_wait", group_wait), ("group_interval", group_interval),
                           ("repeat_interval", repeat_interval)):
            if key in route or route is cfg["route"]:
                route[key] = value
        for child in route.get("routes", []):
            fast(child)

    fast(cfg["route"])
    for receiver in cfg.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url.rstrip('/')}/{receiver['name']}"
    return cfg


# ---------------------------------------------------------------------------------------------
# syncwatch stack up


def register(subparsers) -> None:
    p = subparsers.add_parser("stack", help="run Prometheus and Alertmanager locally")
    sub = p.add_subparsers(dest="stack_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start Prometheus (+ Alertmanager) on loopback until Ctrl-C")
    add_flag(up, "--targets", default="127.0.0.1:9477",
             help="comma-separated daemon host:port list to scrape")
    add_flag(up, "--prometheus-port", type=int, default=9090, help="Prometheus port (0 = free)")
    add_flag(up, "--alertmanager-port", type=int, default=9093, help="Alertmanager port (0 = free)")
    add_flag(up, "--no-alertmanager", action="store_true", help="run Prometheus only")
    add_flag(up, "--alertmanager-config", type=Path, default=None,
             help="Alertmanager configuration file (default: the shipped "
                  "deploy/alertmanager/alertmanager.yml)")
    add_flag(up, "--scrape-interval", default="5s", help="scrape and rule evaluation interval")
    add_flag(up, "--time-scale", type=float, default=1.0,
             help="render the rules with every window scaled by this factor")
    add_flag(up, "--data-dir", default=None, help="keep Prometheus/Alertmanager data here (default: temporary)")
    up.set_defaults(func=run_up)


def shipped_prometheus_config(targets: Sequence[str], rule_files: Sequence[Path], interval: str,
                              alertmanager_url: str | None) -> dict:
    """``deploy/prometheus/prometheus.yml`` (the file docker compose mounts) with only what differs
    on this machine replaced: the daemon targets, the Alertmanager address, absolute rule file
    paths and the intervals. Job name, scrape limits and everything else stay as shipped."""
    config = yaml.safe_load(shipped("deploy/prometheus/prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    if alertmanager_url:
        hostport = urllib.parse.urlsplit(alertmanager_url).netloc
        config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [hostport]}]}]
    else:
        config.pop("alerting", None)
    for job in config["scrape_configs"]:
        if job["job_name"] == "syncwatch":
            job["static_configs"] = [{"targets": list(targets)}]
    return config


# Prometheus' duration syntax (prometheus/common model.ParseDuration), units in this order.
PROMETHEUS_DURATION = re.compile(r"(?:\d+y)?(?:\d+w)?(?:\d+d)?(?:\d+h)?(?:\d+m)?(?:\d+s)?(?:\d+ms)?")


def run_up(args: argparse.Namespace) -> int:
    from .rules.render import write

    # Checked here: Prometheus would only exit on them, after the stack had started around it.
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        print(f"syncwatch stack up: {named(args, '--time-scale')} must be a positive number, "
              f"got {args.time_scale:g}", file=sys.stderr)
        return 2
    for flag, port in (("--prometheus-port", args.prometheus_port),
                       ("--alertmanager-port", args.alertmanager_port)):
        if not 0 <= port <= 65535:
            print(f"syncwatch stack up: {named(args, flag)} must be a port 0-65535 (0 = free), "
                  f"got {port}", file=sys.stderr)
            return 2
    if not args.scrape_interval or not PROMETHEUS_DURATION.fullmatch(args.scrape_interval):
        print(f"syncwatch stack up: {named(args, '--scrape-interval')} {args.scrape_interval!r} "
              f"is not a Prometheus duration (e.g. 5s, 1m, 1m30s)", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if not _host_port(t)]
    if bad or not targets:
        print(f"syncwatch stack up: {named(args, '--targets')} {args.targets!r}: expected daemon "
              f"host:port pairs, comma separated (e.g. 127.0.0.1:9477,node2:9477)", file=sys.stderr)
        return 2
    work = Path(args.data_dir or tempfile.mkdtemp(prefix="sw-stack-"))
    servers: list[_Server] = []
    previous = _stop_on_signals()
    try:
        # The shipped rule files themselves, unless their windows are to be scaled.
        rule_files = (sorted(shipped("alerts").glob("*.rules.yml")) if args.time_scale == 1
                      else write(work / "rules", args.time_scale))
        am = None
        if not args.no_alertmanager:
            am = Alertmanager(args.alertmanager_config
                              or shipped("deploy/alertmanager/alertmanager.yml"),
                              workdir=str(work / "alertmanager"))
            am.start(port=args.alertmanager_port)
            servers.append(am)
        prom = Prometheus(workdir=str(work / "prometheus"))
        prom.config = shipped_prometheus_config(targets, rule_files, args.scrape_interval,
                                                am.url if am else None)
        prom.start(port=args.prometheus_port)
        servers.append(prom)
        print(f"prometheus   {prom.url}  (scraping {', '.join(targets)})", flush=True)
        if am:
            print(f"alertmanager {am.url}", flush=True)
        print("Ctrl-C stops.", flush=True)
        while not _stopping[0]:
            for s in servers:
                if s.proc.poll() is not None:
                    print(f"{s.name} exited; log:\n{s.log_tail()}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (StackError, OSError) as e:
        print(f"syncwatch stack up: {e}", file=sys.stderr)
        return 1
    finally:
        for s in reversed(servers):
            s.stop()
        if not args.data_dir:
            shutil.rmtree(work, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stopping[0] = False
    return 0


def _host_port(target: str) -> bool:
    """Whether ``target`` is ``host:port`` (``[::1]:9477`` too): Prometheus would scrape a bare
    host on port 80 and show it down, with the stack up around it."""
    host, sep, port = target.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536)


def _stop_on_signals() -> dict:
    """Ctrl-C, SIGTERM and SIGHUP (``kill``, a closed terminal) stop the stack, from before the
    first server starts: the servers run in sessions of their own, and a stack killed while one
    started, or by a signal it did not handle, left them running. The handler only sets
    ``_stopping``, which the start and the main loop check: one raising KeyboardInterrupt could
    land inside ``subprocess.Popen``, after the server was forked but before the stack held it,
    and left it running. Returns the handlers it replaced (none off the main thread, where
    Python cannot set any)."""
    _stopping[0] = False
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, frame):
        _stopping[0] = True
    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

