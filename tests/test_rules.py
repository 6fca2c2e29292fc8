"""The rules layer: rendered files are current, valid, conventional, and every alert is tested."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, subprocess_env
from syncwatch.rules.render import duration, render
from syncwatch.rules.thresholds import WINDOWS

ALERTS = ROOT / "alerts"
TESTS = ALERTS / "tests"
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package: prometheus)")

SCORES_TABLE = (  # DESIGN.md, "Scores (recording rules, per train job)"
    "train_job:syncwatch_step_seconds:mean5m", "train_job:syncwatch_sync_tax:ratio5m",
    "train_job:syncwatch_coupling:ratio5m", "train_job:syncwatch_straggler_concentration:ratio10m",
    "train_job:syncwatch_instability:score", "train_job:syncwatch_efficiency:ratio_to_baseline",
    "train_job:syncwatch_energy_per_sample:joules5m")
NAMES_RANK_AND_NODE = ("SyncwatchPersistentStraggler", "SyncwatchRankDesynchronized",
                       "SyncwatchRankLost", "SyncwatchGpuThrottlingOnStraggler")


def _rules(files: dict[str, str] | None = None) -> list[dict]:
    files = files or {p.name: p.read_text() for p in ALERTS.glob("*.rules.yml")}
    return [r for text in files.values() for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def _alerts() -> list[dict]:
    return [r for r in _rules() if "alert" in r]


def _minutes(d: str) -> float:
    total = 0.0
    for n, unit in re.findall(r"(\d+)(ms|h|m|s)", d):
        total += int(n) * {"h": 60, "m": 1, "s": 1 / 60, "ms": 1 / 60000}[unit]
    return total


def test_committed_rule_files_are_the_render_of_the_python_source():
    rendered = render(1.0)
    committed = {p.name: p.read_text() for p in ALERTS.glob("*.rules.yml")}
    assert sorted(committed) == sorted(rendered), "alerts/ holds files the render does not produce"
    stale = [n for n in rendered if committed[n] != rendered[n]]
    assert not stale, f"stale: {stale}; run: python -m syncwatch rules render"


def test_duration_format():
    assert [duration(s) for s in (300, 3600, 90, 15, 0.75, 5400)] == \
        ["5m", "1h", "1m30s", "15s", "750ms", "1h30m"]
    with pytest.raises(ValueError):
        duration(0)


def test_time_scale_shortens_every_window_and_for_but_keeps_names_and_thresholds():
    full, fast = _rules(render(1.0)), _rules(render(0.05))
    assert [r.get("record") or r.get("alert") for r in full] == \
        [r.get("record") or r.get("alert") for r in fast]
    for a, b in zip(full, fast):
        if "for" in a:
            assert _minutes(b["for"]) == pytest.approx(_minutes(a["for"]) * 0.05)
        wa = [_minutes(w) for w in re.findall(r"\[(\w+):?\]|offset (\w+)", a["expr"]) for w in w if w]
        wb = [_minutes(w) for w in re.findall(r"\[(\w+):?\]|offset (\w+)", b["expr"]) for w in w if w]
        assert wb == pytest.approx([x * 0.05 for x in wa])
        strip = lambda e: re.sub(r"\[\w+:?\]|offset \w+|\b\d+(\.\d+)?\b", "", e)  # noqa: E731
        assert strip(a["expr"]) == strip(b["expr"])
    stall = next(r for r in fast if r.get("alert") == "SyncwatchJobStalled")
    assert "  15\n" in stall["expr"]  # the 5m minimum allowance, scaled, compared with time()
    with pytest.raises(ValueError):
        render(0)


def test_trailing_baselines_end_before_the_for_and_rate_window_of_their_alerts():
    """A change held for EfficiencyDrift's (EnergyOutpacingOutput's) for: is in the 5m rates for
    that long plus the rate window; the baseline ends before, so the change is not its own baseline
    (ending 10m back, it took a 25 % throughput drop in from 10m on and the alert never fired)."""
    w = WINDOWS
    assert w.trailing_offset >= max(w.for_efficiency, w.for_energy) + w.rate
    for scale in (1.0, 0.05):
        records = {r["record"]: r["expr"] for r in _rules(render(scale)) if "record" in r}
        for name in ("train_job:syncwatch_samples_per_gpu:baseline1h",
                     "train_job:syncwatch_energy_per_sample:baseline1h"):
            assert records[name].endswith(
                f"[{duration(w.trailing * scale)}] offset {duration(w.trailing_offset * scale)})"), name
        # the step CV and skew growths keep their own, shorter offset
        for name in ("train_job:syncwatch_step_cv:baseline", "train_job:syncwatch_skew_step:baseline"):
            assert records[name].endswith(f"offset {duration(w.baseline_offset * scale)})"), name


def test_recording_rule_names_follow_level_metric_operation_and_cover_the_scores_table():
    records = {r["record"] for r in _rules() if "record" in r}
    for name in records:
        assert re.fullmatch(r"[a-z_]+:syncwatch_[a-z0-9_]+:[a-z0-9_]+", name), name
    assert set(SCORES_TABLE) <= records
    documented = (ROOT / "docs" / "rules.md").read_text()
    missing = [n for n in records if f"`{n}`" not in documented]
    assert not missing, f"recording rules missing from docs/rules.md: {missing}"


def test_alert_conventions_and_runbook_sections():
    anchors = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.M)}
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert len(names) >= 20
    for a in _alerts():
        name = a["alert"]
        assert re.fullmatch(r"Syncwatch[A-Z][A-Za-z]+", name), name
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = a["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, name
        assert "{{" not in ann["summary"], f"{name}: summary must be fixed"
        if name != "SyncwatchWatchdog":
            assert "{{" in ann["description"], f"{name}: description must be templated"
        if "train_job" in a["expr"] and "by (instance" not in a["expr"]:
            assert "$labels.train_job" in ann["description"], f"{name} must name the train job"
        if name in NAMES_RANK_AND_NODE:
            assert "$labels.rank" in ann["description"] and "$labels.node" in ann["description"], name
        anchor = ann["runbook_url"].rsplit("#", 1)[1]
        assert anchor == name.lower() and anchor in anchors, f"{name}: no runbook section #{anchor}"


def test_every_alert_has_a_promtool_test_bracketing_its_for_window_and_a_negative_case():
    for_of = {a["alert"]: _minutes(a["for"]) if "for" in a else 0.0 for a in _alerts()}
    firing: dict[str, list[float]] = {}
    silent: dict[str, list[float]] = {}
    negative: set[str] = set()
    for path in TESTS.glob("*.test.yml"):
        for group in yaml.safe_load(path.read_text())["tests"]:
            is_negative = group.get("name", "").startswith("negative")
            for case in group.get("alert_rule_test", []):
                name, t = case["alertname"], _minutes(case["eval_time"])
                if case.get("exp_alerts"):
                    firing.setdefault(name, []).append(t)
                else:
                    silent.setdefault(name, []).append(t)
                    if is_negative:
                        negative.add(name)
    problems = []
    for name, f in for_of.items():
        if name not in firing:
            problems.append(f"{name}: no firing case")
            continue
        if f and not any(t - 1 in silent.get(name, []) for t in firing[name]):
            problems.append(f"{name}: no silent case one evaluation before a firing case")
        if f and name != "SyncwatchWatchdog" and name not in negative:
            problems.append(f"{name}: no named negative case")
    assert not problems, "\n".join(problems)


@needs_promtool
def test_promtool_check_rules():
    files = sorted(str(p) for p in ALERTS.glob("*.rules.yml"))
    out = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_shipped_rules():
    files = sorted(str(p) for p in TESTS.glob("*.test.yml"))
    assert len(files) >= 8
    out = subprocess.run([PROMTOOL, "test", "rules", *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(files)


@needs_promtool
def test_scaled_render_is_valid_promql(tmp_path):
    for name, text in render(0.05).items():
        (tmp_path / name).write_text(text)
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, sorted(tmp_path.iterdir()))],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_render_writes_and_check_detects_stale_files(tmp_path):
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "syncwatch", "rules", "render", "--out", str(tmp_path), *a],
        capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path)
    out = run("--time-scale", "0.05")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "recording.rules.yml").is_file()
    assert "[15s]" in (tmp_path / "recording.rules.yml").read_text()
    assert run("--check", "--time-scale", "0.05").returncode == 0
    stale = run("--check")  # the files hold the 0.05 render, not the 1.0 one
    assert stale.returncode == 1 and "not current" in stale.stderr
    # the command it gives writes what it compared against: it said "syncwatch rules render",
    # which writes the unscaled rules into the checkout's alerts/
    (tmp_path / "recording.rules.yml").write_text("")
    stale = run("--check", "--time-scale", "0.05")
    assert stale.returncode == 1
    assert f"not current; run: syncwatch rules render --out {tmp_path} --time-scale 0.05" in stale.stderr
    bad = run("--time-scale", "-1")
    assert bad.returncode == 2 and "time scale must be > 0" in bad.stderr
    (tmp_path / "a-file").write_text("")  # --out a file: a FileExistsError traceback
    bad = subprocess.run([sys.executable, "-m", "syncwatch", "rules", "render", "--out",
                          str(tmp_path / "a-file")], capture_output=True, text=True,
                         env=subprocess_env(), cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"syncwatch rules render: cannot write into {tmp_path / 'a-file'}")
