"""Helpers shared by the analysis tests."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from syncwatch import cli
from syncwatch.stack import Prometheus, free_port, http_get

# What diagnose must find in each simulator scenario, whether read from a recording or Prometheus.
SCENARIO_MODES = {"healthy": set(), "straggler": {"straggler_persistent"}, "oscillation": {"oscillation"},
                  "congestion": {"fabric_contention"}, "thermal": {"thermal_coupling"},
                  "restarts": {"checkpoint_restart"}}


def run_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, str]:
    """Run ``syncwatch ARGV`` in-process through ``cli.main`` with only the analysis subcommands
    registered (the others belong to other tests), returning (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS",
                        {k: v for k, v in cli.SUBCOMMANDS.items() if v.startswith("syncwatch.analysis.")})
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(monkeypatch, capsys, argv: list[str]) -> dict:
    code, out, err = run_cli(monkeypatch, capsys, argv + ["--json"])
    assert code == 0, err
    return json.loads(out)


def openmetrics(series: list[tuple[str, dict, list[tuple[float, float]]]]) -> str:
    """``(metric, labels, [(unix seconds, value)])`` rows as OpenMetrics text (``_total``: a counter)."""
    families: dict[str, list[str]] = {}
    for name, labels, points in series:
        family, kind = (name[:-6], "counter") if name.endswith("_total") else (name, "gauge")
        lines = families.setdefault(family, [f"# TYPE {family} {kind}"])
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        lines += [f"{name}{{{lab}}} {v} {t:.3f}" for t, v in sorted(points)]
    return "\n".join(line for lines in families.values() for line in lines) + "\n# EOF\n"


class _WebConfigPrometheus(Prometheus):
    """Prometheus started with ``--web.config.file`` (e.g. ``basic_auth_users``): every endpoint,
    /-/ready included, may answer 401, which still means it is up."""

    def __init__(self, web_config: dict, **kw):
        super().__init__(**kw)
        self.web_config_path = self.workdir / "web.yml"
        self.web_config_path.write_text(yaml.safe_dump(web_config))

    def _args(self) -> list[str]:
        return [*super()._args(), f"--web.config.file={self.web_config_path}"]

    def _ready(self) -> bool:
        try:
            http_get(self.url + self.ready_path, timeout=2)
        except urllib.error.HTTPError as e:
            return e.code == 401
        except (urllib.error.URLError, OSError):
            return False
        return True


def backfilled_prometheus(workdir: Path, series: list[tuple[str, dict, list[tuple[float, float]]]],
                          web_config: dict | None = None):
    """A real Prometheus (not started) whose storage already holds ``series``; ``web_config``: its
    web configuration file (``basic_auth_users``: {user: bcrypt hash} asks every request for them).

    The samples are written as OpenMetrics and turned into TSDB blocks with ``promtool tsdb
    create-blocks-from openmetrics`` before the server starts: exact counter values at chosen
    times in a few seconds, where scraping real daemons (``test_analysis_e2e.py``) takes ~30 s
    and cannot place a restart or a range edge to the second.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / "backfill.om"
    source.write_text(openmetrics(series))
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source),
                    str(workdir / "data")], check=True, capture_output=True)
    if web_config is not None:
        return _WebConfigPrometheus(web_config, workdir=str(workdir))
    return Prometheus(workdir=str(workdir))


@contextlib.contextmanager
def victoriametrics(workdir: Path, series: list[tuple[str, dict, list[tuple[float, float]]]]):
    """A real single-node VictoriaMetrics on loopback holding ``series``; yields its URL.

    The samples go in through its Prometheus text import (``/api/v1/import/prometheus``, timestamps
    in milliseconds) and ``/internal/force_flush`` makes them searchable at once.
    """
    port = free_port()
    log = workdir / "victoria-metrics.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([shutil.which("victoria-metrics"), f"-httpListenAddr=127.0.0.1:{port}",
                                 f"-storageDataPath={workdir / 'vm'}", "-retentionPeriod=1y", "-loggerLevel=ERROR"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if http_get(url + "/health").strip() == b"OK":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"VictoriaMetrics did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        lines = []
        for name, labels, points in series:
            lab = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
            lines += [f"{name}{{{lab}}} {v} {round(t * 1000)}" for t, v in points]
        urllib.request.urlopen(urllib.request.Request(url + "/api/v1/import/prometheus",
                                                      data="\n".join(lines).encode(), method="POST"), timeout=30).read()
        http_get(url + "/internal/force_flush")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
