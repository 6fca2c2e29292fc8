"""Helpers shared by the analysis tests."""

from __future__ import annotations

import json

from syncwatch import cli

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
