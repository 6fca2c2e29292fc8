"""deploy/systemd and deploy/slurm: units that systemd accepts, and the Slurm job label."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from deploy_helpers import ROOT

SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = ("syncwatch.socket", "syncwatch.service")
INSTALLED_BINARY = "/usr/local/bin/syncwatch"


def parse_unit(path) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key, []).append(value)
    return sections


@pytest.fixture
def unit_dir(tmp_path):
    """The units with ExecStart pointing at a real executable: systemd-analyze verify checks that
    the binary exists, and where pip put syncwatch differs between machines."""
    wrapper = tmp_path / "syncwatch"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m syncwatch \"$@\"\n")
    wrapper.chmod(0o755)
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        (tmp_path / name).write_text(text.replace(INSTALLED_BINARY, str(wrapper)))
    return tmp_path


def analyze(*args) -> subprocess.CompletedProcess:
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze (Debian package systemd) is not installed")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_units_verify_without_warnings(unit_dir):
    assert INSTALLED_BINARY in (SYSTEMD / "syncwatch.service").read_text()
    result = analyze("verify", *(str(unit_dir / n) for n in UNITS))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr  # unknown keys are only warnings


def test_verify_reports_a_misspelt_key(unit_dir):
    """The check above can fail: systemd ignores a misspelt hardening key with a warning only."""
    service = unit_dir / "syncwatch.service"
    service.write_text(service.read_text().replace("ProtectSystem=", "ProtectSytem="))
    result = analyze("verify", str(service))
    assert "Unknown key" in result.stderr


def test_service_exposure_is_low(unit_dir):
    """systemd's own exposure score (0 = locked down, 10 = unprotected; --threshold counts tenths) stays under 2.0."""
    result = analyze("security", "--offline=yes", "--threshold=20", str(unit_dir / "syncwatch.service"))
    assert result.returncode == 0, result.stdout[-2000:]


def test_nothing_keeps_nvml_from_the_gpu_devices():
    """NVML opens /dev/nvidiactl, /dev/nvidia<N> and /dev/nvidia-uvm (/dev/nvidia-caps/* with
    MIG): any device allow-list denies them. ProtectClock=yes implies DeviceAllow=char-rtc r, and
    on systemd 245 to 251 (Ubuntu 22.04's 249, Debian 11's 247) that entry alone made the device
    cgroup an allow-list: the GPU collector failed with EPERM on every GPU node there, while
    systemd 252 here ignores it (so only the unit's text can show it)."""
    service = parse_unit(SYSTEMD / "syncwatch.service")["Service"]
    false = ("no", "false", "off", "0")
    assert service.get("PrivateDevices", ["no"])[-1] in false
    assert service.get("ProtectClock", ["no"])[-1] in false
    assert "DeviceAllow" not in service and service.get("DevicePolicy", ["auto"]) == ["auto"]
    # What ProtectClock= would add beyond the device list is in the unit anyway: no CAP_SYS_TIME
    # or CAP_WAKE_ALARM, and ~@privileged denies @clock.
    assert service["CapabilityBoundingSet"] == [""]
    assert "~@privileged" in " ".join(service["SystemCallFilter"])
    assert "@clock" in analyze("syscall-filter", "@privileged").stdout


def documented_install_commands() -> list[str]:
    """The commands of docs/deploy.md's systemd install block, split at ``&&``, comments dropped."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```sh\n(.*?)\n```", text[text.index("## systemd and Slurm"):], re.S).group(1)
    return [c.strip() for line in block.splitlines() for c in line.split("#")[0].split("&&") if c.strip()]


def test_documented_install_uses_no_system_pip_and_provides_execstart():
    """Debian 12 and Ubuntu 23.04 on mark their Python externally managed (PEP 668): the
    documented ``pip install syncwatch`` as root stopped at "error: externally-managed-
    environment" (checked on this Debian 12), so nothing made ExecStart's /usr/local/bin/syncwatch
    and the service failed with 203/EXEC. The daemon goes into a virtual environment, linked
    where ExecStart= expects it."""
    commands = documented_install_commands()
    venvs = [c.split()[-1] for c in commands if c.startswith("python3 -m venv ")]
    pips = [c for c in commands if re.search(r"\bpip3? install\b", c)]
    assert pips
    for command in pips:
        assert command.split()[0] in {f"{v}/bin/pip" for v in venvs}, f"{command}: not a venv's pip"
    execstart = shlex.split(parse_unit(SYSTEMD / "syncwatch.service")["Service"]["ExecStart"][0])[0]
    links = [c.split()[-2:] for c in commands if c.startswith("ln -s")]
    assert [execstart] == [dst for src, dst in links if src in {f"{v}/bin/syncwatch" for v in venvs}]


def test_socket_unit_matches_the_daemon():
    socket = parse_unit(SYSTEMD / "syncwatch.socket")
    service = parse_unit(SYSTEMD / "syncwatch.service")
    path = socket["Socket"]["ListenDatagram"]
    assert path == ["/run/syncwatch/ingest.sock"]
    assert f"--socket {path[0]}" in service["Service"]["ExecStart"][0]
    assert socket["Socket"]["SocketMode"] == ["0660"] and socket["Socket"]["DirectoryMode"] == ["0750"]
    assert socket["Socket"]["Service"] == ["syncwatch.service"]
    assert "syncwatch.socket" in service["Unit"]["Requires"][0]
    assert service["Service"]["DynamicUser"] == ["yes"]
    assert service["Service"]["CapabilityBoundingSet"] == [""]


def sysusers_names(path) -> tuple[set[str], set[str]]:
    """(users, groups) a sysusers.d file creates: "u NAME" makes a user and its group."""
    users, groups = set(), set()
    for line in path.read_text().splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if fields[0] == "u":
            users.add(fields[1])
            groups.add(fields[1])
        elif fields[0] == "g":
            groups.add(fields[1])
    return users, groups


def test_dynamic_user_does_not_collide_with_the_sysusers_group():
    """systemd names a DynamicUser= after User= (else the unit) and its group after Group= (else
    the user), and refuses to start the service where that user name is a static group without
    a static user of the same name, or the group name a static user without its group
    (dynamic_user_realize(): "User or group with specified name already exists", 217/USER).
    syncwatch.sysusers.conf makes the static group "syncwatch" for the senders: a dynamic user
    named after syncwatch.service never started on a host set up as docs/deploy.md says."""
    service = parse_unit(SYSTEMD / "syncwatch.service")["Service"]
    assert service["DynamicUser"] == ["yes"]
    user = service.get("User", ["syncwatch"])[-1]  # the unit's name, syncwatch.service
    group = service.get("Group", [user])[-1]
    users, groups = sysusers_names(SYSTEMD / "syncwatch.sysusers.conf")
    assert user in users or user not in groups, f"dynamic user {user!r} is a static group's name"
    assert group in groups or group not in users, f"dynamic group {group!r} is a static user's name"
    assert parse_unit(SYSTEMD / "syncwatch.socket")["Socket"]["SocketGroup"] == ["syncwatch"]


def test_socket_unit_sets_no_receive_buffer_because_none_lengthens_the_queue(tmp_path):
    """A Unix datagram socket holds max_dgram_qlen + 1 datagrams whatever its SO_RCVBUF, so a
    ReceiveBuffer= in the unit made no room for bursts (its comment said it did). Measured here
    on a socket with the 4 MiB buffer the unit used to ask for: if a kernel ever bounds the queue
    by bytes instead, this fails and the unit's comment must change."""
    unit = parse_unit(SYSTEMD / "syncwatch.socket")["Socket"]
    assert not any(k.startswith("ReceiveBuffer") for k in unit)
    qlen = int(open("/proc/sys/net/unix/max_dgram_qlen").read())
    queued = {}
    for rcvbuf in (4096, 4 << 20):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx, \
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as tx:
            rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            rx.bind(str(tmp_path / f"rx-{rcvbuf}.sock"))
            tx.setblocking(False)
            tx.connect(str(tmp_path / f"rx-{rcvbuf}.sock"))
            n = 0
            with pytest.raises(BlockingIOError):
                while n < 10_000:
                    tx.send(b"r" * 200)  # a step record's size
                    n += 1
            queued[rcvbuf] = n
    assert queued == {4096: qlen + 1, 4 << 20: qlen + 1}


def daemon_args_under_systemd(monkeypatch, env_file: dict[str, str]):
    """The daemon's parsed command line as syncwatch.service starts it: the unit's Environment=,
    overridden by /etc/default/syncwatch (``env_file``, which systemd gives precedence), then
    ExecStart= through the real CLI."""
    from syncwatch.cli import build_parser
    service = parse_unit(SYSTEMD / "syncwatch.service")["Service"]
    assert service["EnvironmentFile"] == ["-/etc/default/syncwatch"]
    env = dict(a.split("=", 1) for value in service.get("Environment", []) for a in shlex.split(value))
    env.update(env_file)
    for name in [n for n in os.environ if n.startswith("SYNCWATCH_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = shlex.split(service["ExecStart"][0])
    assert argv[0] == INSTALLED_BINARY
    return build_parser().parse_args(argv[1:])


def test_environment_file_configures_the_daemon(monkeypatch):
    """What the unit and docs/deploy.md tell an operator: settings in /etc/default/syncwatch take
    effect (a flag on ExecStart would silently override them), except the socket path, which
    must stay the socket unit's."""
    args = daemon_args_under_systemd(monkeypatch, {})
    assert (args.listen, args.socket) == ("127.0.0.1:9477", "/run/syncwatch/ingest.sock")
    args = daemon_args_under_systemd(monkeypatch, {"SYNCWATCH_LISTEN": "10.0.0.5:9477",
                                                   "SYNCWATCH_MAX_RANKS": "64",
                                                   "SYNCWATCH_SOCKET": "/tmp/elsewhere.sock"})
    assert (args.listen, args.max_ranks) == ("10.0.0.5:9477", 64)
    assert args.socket == parse_unit(SYSTEMD / "syncwatch.socket")["Socket"]["ListenDatagram"][0]


def test_the_daemon_starts_once_the_network_is_online():
    """SYNCWATCH_LISTEN may name the node's address, which does not exist before the network is
    online: with After=network.target the daemon could start first and fail to bind."""
    unit = parse_unit(SYSTEMD / "syncwatch.service")["Unit"]
    assert "network-online.target" in unit["Wants"][0].split()
    assert "network-online.target" in unit["After"][0].split()


def task_prolog(**env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SYNCWATCH_"))}
    result = subprocess.run(["sh", str(ROOT / "deploy" / "slurm" / "task-prolog.sh")],
                            env={**clean, **env}, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0 and result.stderr == ""
    return result.stdout.splitlines()


def test_task_prolog_labels_the_job_with_its_slurm_id():
    # torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none, which would otherwise win.
    assert task_prolog(SLURM_JOB_ID="4242", TORCHELASTIC_RUN_ID="none") == [
        "export SYNCWATCH_JOB=4242", "export SYNCWATCH_SOCKET=/run/syncwatch/ingest.sock"]


def test_task_prolog_keeps_what_the_user_set():
    assert task_prolog(SLURM_JOB_ID="4242", SYNCWATCH_JOB="bert-large",
                       SYNCWATCH_UDP="127.0.0.1:9478") == []
    assert task_prolog() == []  # outside a Slurm job
