"""End to end: simulator scenarios -> real daemons (UDP on loopback) -> a real Prometheus ->
``syncwatch diagnose`` / ``project`` / ``report`` over the HTTP API.

All six scenarios run at once, each its own train job, in real time scaled down (one simulated
second = 25 ms) and scraped every 0.5 s by one Prometheus (module fixture), so the whole file takes
~50 s (``congestion``, 1200 steps, the longest). Four share four plain daemons; ``thermal`` and ``congestion`` each get four daemons of their
own whose nodes have simulated hardware (``syncwatch.sim.hardware``: fake GPUs and RoCE ports
advanced from the simulation), so diagnose must cite GPU and fabric evidence for them — and node
hardware, which belongs to no job, does not leak into the other scenarios' diagnoses. The skew exchange runs every 10 steps (``exchange_every``)
so that each 1.5 s analysis window (~50 steps) spans several exchanges: slack counters advance
once per exchange, and a window shorter than a few exchange periods sees them lag the sync time.
``healthy`` and ``straggler`` also run a second time with the exchange off (K = 0, jobs
``e2e-healthy-k0`` and ``e2e-straggler-k0``): no slack, last-arrival or skew series at all, so
every command works from the estimates it derives from the mean waits.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from analysis_helpers import SCENARIO_MODES, run_cli
from syncwatch.analysis.prom import Prometheus as PromClient
from syncwatch.analysis.prom import label
from syncwatch.stack import Prometheus, wait_until

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus missing (Debian package: prometheus)")
daemon_app = pytest.importorskip("syncwatch.daemon.app", reason="the daemon (syncwatch.daemon) is not in this checkout")
daemon_config = pytest.importorskip("syncwatch.daemon.config")
scenarios = pytest.importorskip("syncwatch.sim.scenarios", reason="the simulator (syncwatch.sim) is not in this checkout")
hardware_mod = pytest.importorskip("syncwatch.sim.hardware")

NODES, RANKS_PER_NODE = 4, 4
TIME_SCALE = 0.025
SCRAPE = 0.5
HARDWARE = ("thermal", "congestion")  # scenarios on their own daemons with simulated hardware
WITHOUT_EXCHANGE = ("healthy", "straggler")  # also run with the skew exchange off, as NAME-k0
# congestion runs 3x its default: its fabric counters are correlated with the collective time over
# the 1.5 s windows, and over the default's ~10 windows r swung from 0.39 to 0.97 between runs on
# a loaded machine (two busy loops beside the test); over ~30 windows it read 0.76-0.81
STEPS = {"congestion": 1200}


def _daemon(extra=()):
    return daemon_app.DaemonThread(daemon_config.DaemonConfig(
        listen="127.0.0.1:0", socket=None, udp="127.0.0.1:0"), extra_collectors=extra)


@pytest.fixture(scope="module")
def cluster():
    """Run every scenario through real daemons into one real Prometheus; yield (url, {name: (start, end)})."""
    hardware = {name: hardware_mod.SimulatedHardware(NODES, RANKS_PER_NODE, f"e2e-{name}-node-",
                                                     period=0.1) for name in HARDWARE}  # ticks << windows
    daemons = {None: [_daemon() for _ in range(NODES)]}
    for name, hw in hardware.items():
        daemons[name] = [_daemon((node.collectors(SCRAPE / 2),)) for node in hw.nodes]
    running = {k: [x.start() for x in ds] for k, ds in daemons.items()}
    prom = Prometheus([r.url.split("//", 1)[1] for rs in running.values() for r in rs],
                      scrape_interval=f"{int(SCRAPE * 1000)}ms")
    try:
        prom.start()
        wait_until(prom.targets_up, 20, what="a first scrape of every daemon")
        threads, ranges = {}, {}
        runs = [(name, name, 10) for name in SCENARIO_MODES] + [(f"{name}-k0", name, 0) for name in WITHOUT_EXCHANGE]
        for key, name, every in runs:
            own = name in hardware
            t = scenarios.ScenarioThread(name, [{"udp": r.udp_address} for r in running[name if own else None]],
                                         NODES, RANKS_PER_NODE, steps=STEPS.get(name, scenarios.DEFAULT_STEPS[name]),
                                         job=f"e2e-{key}", fast=False, time_scale=TIME_SCALE, seed=1,
                                         exchange_every=every,
                                         node_prefix=f"e2e-{name}-node-" if own else "sim-node-")
            if own:
                hardware[name].follow(t.driver)
            ranges[key] = [time.time() - 1.0, None]
            t.start()
            threads[key] = t
        for name, t in threads.items():
            t.join(120)
            assert not t.is_alive() and t.error is None, (name, t.error)
            ranges[name][1] = time.time()
        time.sleep(3 * SCRAPE)  # the last records reach a scrape
        yield prom.url, {k: (s, e + 2 * SCRAPE) for k, (s, e) in ranges.items()}
    finally:
        prom.stop()
        for ds in daemons.values():
            for x in ds:
                x.stop()
        for hw in hardware.values():
            hw.close()


def _diagnose(monkeypatch, capsys, url, ranges, name) -> dict:
    start, end = ranges[name]
    code, out, err = run_cli(monkeypatch, capsys, [
        "diagnose", "--prometheus", url, "--job", f"e2e-{name}", "--start", f"{start:.3f}",
        "--end", f"{end:.3f}", "--window", "1.5", "--json"])
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", sorted(SCENARIO_MODES))
def test_scenario_diagnosed_through_prometheus(cluster, name, monkeypatch, capsys):
    d = _diagnose(monkeypatch, capsys, *cluster, name)
    modes = {f["mode"] for f in d["findings"]}
    assert modes == SCENARIO_MODES[name], (modes, json.dumps(d["findings"], indent=1)[:3000])
    assert d["ranks"] == NODES * RANKS_PER_NODE, d["scores"]
    if name == "healthy":
        assert d["verdict"] == "no structural problem found"


def test_thermal_diagnosis_cites_the_throttling_gpus(cluster, monkeypatch, capsys):
    d = _diagnose(monkeypatch, capsys, *cluster, "thermal")
    (finding,) = [f for f in d["findings"] if f["mode"] == "thermal_coupling"]
    (hw,) = [e for e in finding["evidence"]
             if e["series"] == "syncwatch_gpu_throttle_active / syncwatch_gpu_temperature_celsius"]
    hot = hw["reading"].removeprefix("straggling nodes ").removesuffix(" throttle or run hot").split(", ")
    assert hot and set(hot) <= set(finding["subject"]["nodes"]), finding
    assert all(n.startswith("e2e-thermal-node-") for n in hot)
    assert finding["confidence"] >= 0.85
    assert not any("no GPU telemetry" in n for n in d["notes"]), d["notes"]


def test_congestion_diagnosis_cites_the_fabric_counters(cluster, monkeypatch, capsys):
    d = _diagnose(monkeypatch, capsys, *cluster, "congestion")
    (finding,) = [f for f in d["findings"] if f["mode"] == "fabric_contention"]
    corr = {e["series"].split()[0]: e["value"] for e in finding["evidence"] if "sum over nodes" in e["series"]}
    assert set(corr) == {"ib_xmit_wait_rate", "roce_congestion_rate"}, finding["evidence"]
    # The counters follow the collective time: each rises with it, and one of them (or the sync
    # tax) by r >= 0.5, the 0.9 confidence. The daemons collect the counters every 0.25 s apart
    # from the records, so they trail them into the next 1.5 s window by a share that grows with
    # the load; over the ~30 windows of 1200 steps r read 0.76-0.81 beside two busy loops.
    assert min(corr.values()) > 0, corr
    assert finding["confidence"] >= 0.9, finding["evidence"]


@pytest.mark.parametrize("name", ["straggler", "straggler-k0"])
def test_the_series_a_straggler_finding_cites_select_the_straggler(cluster, name, monkeypatch, capsys):
    """Each evidence line that quotes a selector, pasted into Prometheus, selects the straggler's
    series. They matched a ``node`` label these series do not carry, and selected nothing."""
    url, ranges = cluster
    d = _diagnose(monkeypatch, capsys, url, ranges, name)
    (f,) = [f for f in d["findings"] if f["mode"] == "straggler_persistent"]
    quoted = [e["series"].split(", per window")[0] for e in f["evidence"]
              if e["series"].startswith("syncwatch_") and "{" in e["series"]]
    assert quoted, f["evidence"]
    prom = PromClient(url)
    for expr in quoted:
        got = prom.query(expr, ranges[name][1])
        assert [label(k, "rank") for k in got] == [str(f["subject"]["rank"])], (expr, got)


def _run(monkeypatch, capsys, url, ranges, command, name, *extra) -> str:
    start, end = ranges[name]
    code, out, err = run_cli(monkeypatch, capsys, [
        command, "--prometheus", url, "--job", f"e2e-{name}", "--start", f"{start:.3f}",
        "--end", f"{end:.3f}", "--window", "1.5", *extra])
    assert code == 0, err
    return out


def test_straggler_without_the_skew_exchange_is_named_from_mean_waits(cluster, monkeypatch, capsys):
    """With K = 0 the daemons export no slack or last arrivals: diagnose said "no structural
    problem found" for a job whose rank 5 was 8 % slower than the others."""
    d = json.loads(_run(monkeypatch, capsys, *cluster, "diagnose", "straggler-k0", "--json"))
    (f,) = d["findings"]
    assert f["mode"] == "straggler_persistent", d
    assert f["subject"] == {"rank": scenarios.straggler_rank(NODES * RANKS_PER_NODE), "node": "sim-node-01"}
    assert "estimated from mean waits" in f["phenomenon"]
    # no exact series is cited as evidence: they do not exist for this job
    assert not [e for e in f["evidence"] if "_total" in e["series"] and "phase=" not in e["series"]], f["evidence"]
    assert d["scores"]["coupling"] == pytest.approx(0.065, abs=0.02)   # exact: 6.5 % (K = 10)
    assert d["estimated"] == ["coupling", "straggler_concentration", "collective_seconds"]
    text = _run(monkeypatch, capsys, *cluster, "diagnose", "straggler-k0")
    assert "Persistent straggler: rank 5 on sim-node-01" in text
    assert "n/a" not in text and "nan" not in text.lower()


def test_healthy_job_without_the_skew_exchange_is_healthy_with_what_was_not_measured(cluster, monkeypatch, capsys):
    d = json.loads(_run(monkeypatch, capsys, *cluster, "diagnose", "healthy-k0", "--json"))
    assert d["findings"] == [] and d["healthy"], d["findings"]
    assert "transient jitter and a straggling node that moves between nodes are not ruled out" in d["verdict"]
    assert d["scores"]["coupling"] < 0.025 and d["scores"]["straggler_concentration"] < 0.5, d["scores"]
    text = _run(monkeypatch, capsys, *cluster, "diagnose", "healthy-k0")
    assert "arrival patterns" not in text and "n/a" not in text and "nan" not in text.lower(), text


@pytest.mark.parametrize("name", [f"{n}-k0" for n in WITHOUT_EXCHANGE])
def test_project_without_the_skew_exchange_says_what_it_estimated(cluster, name, monkeypatch, capsys):
    """It exited 2: "the projection needs slack counters ... turn on the exact skew exchange"."""
    res = json.loads(_run(monkeypatch, capsys, *cluster, "project", name, "--json"))
    assert res["measured"]["estimated"] == ["coupling", "sigma", "collective"]
    assert res["model_at_measured"]["mean_step_seconds"] == pytest.approx(res["measured"]["mean_step"], rel=0.05)
    assert res["projections"][-1]["mean_step_seconds"] > res["model_at_measured"]["mean_step_seconds"]
    assert "estimated from mean waits (skew exchange off)" in _run(monkeypatch, capsys, *cluster, "project", name)


@pytest.mark.parametrize("name", [f"{n}-k0" for n in WITHOUT_EXCHANGE])
def test_report_without_the_skew_exchange_fills_every_section(cluster, name, tmp_path, monkeypatch, capsys):
    """Its straggler map and projection were empty charts, its coupling line a false 0 %."""
    html = tmp_path / "r.html"
    summary = json.loads(_run(monkeypatch, capsys, *cluster, "report", name, "--output", str(html), "--json"))
    assert summary["projection"] and summary["healthy"] == (name == "healthy-k0"), summary
    text = html.read_text()
    assert "Estimated last arrivals per rank (rank node)" in text and "no data in range" not in text
    assert "no projection" not in text and "n/a" not in text and "nan" not in text.lower()
    assert text.count("<svg") >= 9


def test_unknown_job_and_empty_range_exit_2(cluster, monkeypatch, capsys):
    url, ranges = cluster
    start, end = ranges["healthy"]
    code, _, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", url, "--job", "nope",
                                                 "--start", f"{start:.0f}", "--end", f"{end:.0f}"])
    assert code == 2 and "unknown train job 'nope'" in err and "e2e-healthy" in err
    code, _, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", url, "--job", "e2e-healthy",
                                                 "--start", f"{end:.0f}", "--end", f"{start:.0f}"])
    assert code == 2 and "empty time range" in err


def test_project_and_report_from_prometheus(cluster, tmp_path, monkeypatch, capsys):
    url, ranges = cluster
    start, end = ranges["healthy"]
    base = ["--prometheus", url, "--job", "e2e-healthy", "--start", f"{start:.3f}", "--end", f"{end:.3f}",
            "--window", "1.5"]
    code, out, err = run_cli(monkeypatch, capsys, ["project", *base, "--json"])
    assert code == 0, err
    res = json.loads(out)
    assert res["measured"]["method"].startswith("prometheus")
    assert res["measured"]["ranks"] == NODES * RANKS_PER_NODE
    # the model at the measured scale reproduces the measured mean step
    assert res["model_at_measured"]["mean_step_seconds"] == pytest.approx(res["measured"]["mean_step"], rel=0.05)
    assert res["projections"][-1]["mean_step_seconds"] > res["model_at_measured"]["mean_step_seconds"]
    html = tmp_path / "r.html"
    code, out, err = run_cli(monkeypatch, capsys, ["report", *base, "--output", str(html), "--json"])
    assert code == 0, err
    assert json.loads(out)["healthy"] and html.read_text().count("<svg") >= 8
