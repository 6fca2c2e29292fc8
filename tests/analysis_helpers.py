"""Helpers shared by the analysis tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from syncwatch import cli
from syncwatch.stack import Prometheus

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


def backfilled_prometheus(workdir: Path, series: list[tuple[str, dict, list[tuple[float, float]]]]):
    """A real Prometheus (not started) whose storage already holds ``series``.

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
    return Prometheus(workdir=str(workdir))
