"""Every syncwatch command line the deployments run is accepted by this checkout's CLI."""

from __future__ import annotations

import shlex

import pytest
import yaml

from deploy_helpers import ROOT, load_all
from syncwatch.cli import build_parser


def compose_commands():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("syncwatch", "demo"):
        yield f"compose {name}", list(services[name]["command"])


def kubernetes_commands():
    daemonset = load_all(ROOT / "deploy" / "kubernetes" / "daemonset.yaml")[0]
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    yield "kubernetes daemonset", list(args)


def systemd_commands():
    for line in (ROOT / "deploy" / "systemd" / "syncwatch.service").read_text().splitlines():
        if line.startswith("ExecStart="):
            yield "systemd", shlex.split(line.split("=", 1)[1])[1:]


COMMANDS = [*compose_commands(), *kubernetes_commands(), *systemd_commands()]


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_line_is_accepted(where, argv):
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_a_wrong_flag_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["daemon", "--path.sysfz=/host/sys"])



def test_help_prints_a_default_only_where_there_is_one():
    """``--help`` of every subcommand: a flag without a default says nothing of one (no
    ``default: None``, no empty ``default: ``); one with a default shows it beside its env twin."""
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"daemon", "run", "stack", "jct", "report"}
    for name, parser in sub.choices.items():
        text = " ".join(parser.format_help().split())  # unwrapped
        assert "default: None" not in text and "default: ]" not in text, (name, text)
        assert "``" not in text, (name, text)  # a module docstring's markup, shown raw
    daemon = " ".join(sub.choices["daemon"].format_help().split())
    assert "[env SYNCWATCH_LISTEN; default: 127.0.0.1:9477]" in daemon
    assert "(empty: off) [env SYNCWATCH_UDP]" in daemon
    run = " ".join(sub.choices["run"].format_help().split())
    assert "(default /run/syncwatch/ingest.sock) [env SYNCWATCH_SOCKET]" in run
    assert "(default 5) [env SYNCWATCH_HEARTBEAT]" in run


def test_a_bad_environment_twin_stops_only_the_command_whose_flag_reads_it(monkeypatch, capsys):
    """``SYNCWATCH_NODES`` is ``project``'s comma-separated list and ``jct``'s count: set for
    ``project``, it stopped every command with ``syncwatch jct: error``, ``--help`` included; a
    collector flag's bad twin raised AttributeError in every command."""
    monkeypatch.setenv("SYNCWATCH_NODES", "16,32")
    monkeypatch.setenv("SYNCWATCH_COLLECTOR_INTERVAL", "soon")
    assert build_parser().parse_args(["project", "--input", "run.json"]).nodes == "16,32"
    assert build_parser().parse_args(["jct", "--nodes", "4"]).nodes == 4  # the flag wins over its twin
    for argv, message in ((["jct"], "syncwatch jct: error: SYNCWATCH_NODES='16,32': "),
                          (["daemon"], "syncwatch daemon: error: SYNCWATCH_COLLECTOR_INTERVAL='soon': ")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_error_about_a_value_names_the_twin_it_came_from(monkeypatch):
    """Errors about a flag's value named the flag alone (``--nodes and --step-time must be
    positive``), also where the value came from its twin: a user who had exported
    ``SYNCWATCH_DEMO_NODES`` and never typed ``--nodes`` could not tell where it came from.
    ``named`` gives the twin where it gave the value, the flag alone where the command line did
    (the same value too)."""
    from syncwatch.cli import named
    monkeypatch.setenv("SYNCWATCH_DEMO_NODES", "0")
    monkeypatch.setenv("SYNCWATCH_COLLECTOR_GPU", "0")
    args = build_parser().parse_args(["demo"])
    assert args.nodes == 0 and named(args, "--nodes") == "--nodes (from SYNCWATCH_DEMO_NODES)"
    assert named(args, "--step-time") == "--step-time"
    args = build_parser().parse_args(["demo", "--nodes", "0"])
    assert args.nodes == 0 and named(args, "--nodes") == "--nodes"
    args = build_parser().parse_args(["daemon"])
    assert args.collector_gpu is False
    assert named(args, "--collector.gpu") == "--collector.gpu (from SYNCWATCH_COLLECTOR_GPU)"
    args = build_parser().parse_args(["daemon", "--no-collector.gpu"])  # its own flag, same dest
    assert args.collector_gpu is False and named(args, "--collector.gpu") == "--collector.gpu"


def test_the_daemons_window_and_the_analysis_window_have_twins_of_their_own(monkeypatch):
    """The daemon's ``--window`` counts steps, the analysis commands' seconds: one shared
    ``SYNCWATCH_WINDOW``, exported for ``diagnose``, gave a daemon started later a 300-step window."""
    monkeypatch.setenv("SYNCWATCH_WINDOW", "300")
    monkeypatch.setenv("SYNCWATCH_ANALYSIS_WINDOW", "60")
    assert build_parser().parse_args(["daemon"]).window == 300
    for command in ("diagnose", "project", "report"):
        assert build_parser().parse_args([command]).window == 60.0


def test_a_sysfs_path_with_nothing_mounted_is_told_at_start(tmp_path, caplog):
    """Compose and the DaemonSet pass ``--path.sysfs=/host/sys``. Where the host's /sys is not
    mounted there (a ``docker run`` without ``-v /sys:/host/sys:ro``, a patched manifest), the net
    and InfiniBand collectors took the missing tree for a node without such hardware: no series,
    ``syncwatch_collector_success`` 1, a debug line only, nothing for anyone to notice."""
    import logging

    from syncwatch import collectors

    argv = next(a for where, a in COMMANDS if where == "kubernetes daemonset")
    assert "--path.sysfs=/host/sys" in argv
    missing = str(tmp_path / "host" / "sys")
    args = build_parser().parse_args([a for a in argv if not a.startswith("--path.sysfs")]
                                     + [f"--path.sysfs={missing}", "--no-collector.gpu"])
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        collectors.runner_from_args(args)
    assert any(missing in r.getMessage() and "mount" in r.getMessage() for r in caplog.records), \
        caplog.text
    caplog.clear()
    (tmp_path / "sys" / "class" / "net").mkdir(parents=True)
    args.path_sysfs = str(tmp_path / "sys")
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        collectors.runner_from_args(args)
    assert not caplog.records, caplog.text
    # only the collectors that read sysfs care
    args.path_sysfs, args.collector_net, args.collector_infiniband = missing, False, False
    assert collectors.runner_from_args(args) is None and not caplog.records
