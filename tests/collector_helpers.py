"""Helpers shared by the collector tests: render collectors, compare with golden files, promtool."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = FIXTURES / "golden"
UPDATE = os.environ.get("SYNCWATCH_UPDATE_GOLDEN") == "1"


class Families:
    """Wraps a list of metric families as a registry collector."""

    def __init__(self, families):
        self.families = list(families)

    def collect(self):
        return self.families


def render(families) -> str:
    registry = CollectorRegistry()
    registry.register(Families(families))
    return generate_latest(registry).decode()


def registry_of(families) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(Families(families))
    return registry


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/fixtures/golden/<name>.prom (SYNCWATCH_UPDATE_GOLDEN=1 rewrites it)."""
    path = GOLDEN / f"{name}.prom"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with SYNCWATCH_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"exposition differs from {path} (SYNCWATCH_UPDATE_GOLDEN=1 regenerates)"


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus'")
    return exe


def promtool_check(text: str) -> None:
    out = subprocess.run([promtool(), "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert not out.stdout.strip() and not out.stderr.strip(), out.stdout.decode() + out.stderr.decode()
