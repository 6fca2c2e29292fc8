"""deploy/systemd and deploy/slurm: units that systemd accepts, and the Slurm job label."""

from __future__ import annotations

import os
import shutil
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
