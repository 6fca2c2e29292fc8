"""Every benchmark script answers ``--help`` with what it measures and exits, running nothing:
four of them had no argument parser and ran in full on ``--help``, two crashed on it."""

from __future__ import annotations

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
