"""Every benchmark script answers ``--help`` with what it measures and exits, running nothing:
four of them had no argument parser and ran in full on ``--help``, two crashed on it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

BENCHMARKS = sorted(p for p in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
                    if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_answers_help_with_its_docstring(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                         timeout=60, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: "), out.stdout
    first = next(line for line in script.read_text().split('"""')[1].splitlines() if line.strip())
    assert first.strip() in " ".join(out.stdout.split()), out.stdout


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus missing (Debian package: prometheus)")
@pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                    reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
def test_the_false_pages_soak_runs_every_healthy_shape_on_the_real_pipeline():
    """One simulated minute (~10 s): every job starts, steps and is reported on, and the summary
    line says how many fired (none can within a minute: every for: is 1m or longer)."""
    script = Path(__file__).parent.parent / "benchmarks" / "false_pages.py"
    out = subprocess.run([sys.executable, str(script), "--minutes", "1"], capture_output=True,
                         text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stdout + out.stderr
    ran = re.findall(r"^soak-\S+: .*\n  ran ([\d.]+) simulated minutes, (\d+) steps", out.stdout, re.M)
    assert len(ran) == 9 and all(float(m) > 0 and int(n) > 0 for m, n in ran), out.stdout
    assert out.stdout.rstrip().endswith("healthy jobs: 9, alerts fired: 0"), out.stdout
