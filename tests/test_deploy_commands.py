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
        yield f"compose {name}", [a.replace("${SYNCWATCH_NODE:-localhost}", "localhost")
                                  for a in services[name]["command"]]


def kubernetes_commands():
    daemonset = load_all(ROOT / "deploy" / "kubernetes" / "daemonset.yaml")[0]
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    yield "kubernetes daemonset", [a.replace("$(NODE_NAME)", "node-1") for a in args]


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
