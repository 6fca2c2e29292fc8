"""``syncwatch diagnose`` on recorded simulator runs (offline): each scenario is its own failure mode."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from analysis_helpers import SCENARIO_MODES, run_cli, run_json
from conftest import subprocess_env
from syncwatch.analysis import recording
from syncwatch.analysis.diagnose import diagnose, summary
from syncwatch.analysis.view import THERMAL_THROTTLE, fmt_time

sim = pytest.importorskip("syncwatch.sim.scenarios", reason="the simulator (syncwatch.sim) is not in this checkout")

START = 1.7e9


def recorded(name: str, seed: int = 0, **params) -> dict:
    truth = sim.run_scenario(name, nodes=4, ranks_per_node=8, seed=seed, params=params or None)
    return recording.from_ground_truth(truth, start_wall=START)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(SCENARIO_MODES))
def test_each_scenario_is_diagnosed_as_its_own_failure_mode(name, seed):
    d = diagnose(recording.to_view(recorded(name, seed), "test"))
    assert {f.mode for f in d.findings} == SCENARIO_MODES[name], [f.title for f in d.findings]
    assert d.healthy == (name == "healthy")


def test_a_few_steps_name_no_straggler():
    """Over 4 steps of a healthy 32-rank job one rank took 2 of the 4 last arrivals (50 %) in 7
    of 40 ranges, and each read as a persistent straggler at 0.75; from 10 steps a straggler is
    named: the injected one over 10 steps once it straggles (it slows from step 20), not over 4."""
    def findings(run, first, last):
        a, b = run["steps"][first], run["steps"][last]
        v = recording.to_view(run, "test", a["t"] + a["seconds"] - 1e-6, b["t"] + b["seconds"] + 1e-6)
        return [f.mode for f in diagnose(v).findings]

    healthy = recorded("healthy")
    assert all("straggler_persistent" not in findings(healthy, i, i + 3) for i in range(0, 280, 7))
    straggler = recorded("straggler")
    assert findings(straggler, 100, 109) == ["straggler_persistent"]
    assert findings(straggler, 100, 103) == []


def test_persistent_straggler_names_rank_and_node():
    d = diagnose(recording.to_view(recorded("straggler"), "test"))
    (f,) = d.findings
    rank = sim.straggler_rank(32)
    assert f.subject == {"rank": rank, "node": "sim-node-00"}
    assert f"rank {rank}" in f.title and f.confidence >= 0.8
    assert any("cordon node sim-node-00" in o for o in f.options)
    assert any(e["series"].startswith("syncwatch_last_arrivals_total") for e in f.evidence)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_taking_a_third_of_last_arrivals_is_no_persistent_straggler(seed):
    """A rank 5 % slower among ranks of 3 % jitter arrives last in about a third of the steps,
    ten times its even share: jitter still decides most steps, so it is transient jitter, not a
    persistent straggler, whose signature asks for half of the last arrivals."""
    run = recorded("straggler", seed, straggler_slowdown=0.05, jitter=0.03)
    d = diagnose(recording.to_view(run, "test"))
    assert 0.3 <= d.scores["straggler_concentration"] < 0.5, d.scores
    assert [f.mode for f in d.findings] == ["straggler_transient"]


def test_scores_are_the_simulators_truth():
    """The figures diagnose reports, from the model's own per-step truth: mean step, sync tax,
    coupling (all ranks' slack over all rank-time), straggler concentration, steps, and the
    collective time (the smallest wait; no congestion episode in this run)."""
    truth = sim.run_scenario("straggler", nodes=4, ranks_per_node=8, seed=0)
    s = diagnose(recording.to_view(recording.from_ground_truth(truth, start_wall=START), "test")).scores
    world, steps = truth.params.world_size, truth.steps
    rank_time = world * sum(st.step_seconds for st in steps)
    assert truth.congested_steps == 0
    assert s["steps"] == truth.executed_steps == 300
    assert s["mean_step_seconds"] == pytest.approx(sum(st.step_seconds for st in steps) / 300, rel=1e-9)
    assert s["sync_tax"] == pytest.approx(sum(sum(st.waits) for st in steps) / rank_time, rel=1e-9)
    assert s["coupling"] == pytest.approx(sum(truth.slack_seconds) / rank_time, rel=1e-9)
    assert s["straggler_concentration"] == pytest.approx(
        max(truth.last_arrivals) / sum(truth.last_arrivals), rel=1e-9)
    assert s["collective_seconds"] == pytest.approx(truth.params.collective_seconds, rel=1e-9)


def test_straggler_on_a_throttling_node_is_also_thermal_with_high_confidence():
    run = recorded("straggler")
    ts = [s["t"] for s in run["steps"]]
    run["hardware"] = {
        "gpu_temperature_celsius": {f"sim-node-{n:02d}": [[t, 88.0 if n == 0 else 70.0] for t in ts] for n in range(4)},
        "gpu_thermal_throttle": {f"sim-node-{n:02d}": [[t, 1.0 if n == 0 else 0.0] for t in ts] for n in range(4)},
    }
    d = diagnose(recording.to_view(run, "test"))
    modes = {f.mode: f for f in d.findings}
    assert set(modes) == {"straggler_persistent", "thermal_coupling"}
    thermal = modes["thermal_coupling"]
    assert thermal.confidence >= 0.9 and thermal.subject == {"node": "sim-node-00"}
    assert any("18.0 °C hotter" in e["reading"] for e in thermal.evidence)
    assert not any("skew exchange off" in n or "GPU telemetry" in n for n in d.notes), d.notes


def test_a_straggler_node_hotter_than_most_others_is_thermal_beside_one_warm_neighbour():
    """The straggling node runs 10 °C above the other nodes' median; one other node running warm
    too (78 °C beside 70 °C) leaves it as much hotter than the cluster, not 2 °C."""
    run = recorded("straggler")
    ts = [s["t"] for s in run["steps"]]
    temps = {"sim-node-00": 80.0, "sim-node-01": 78.0, "sim-node-02": 70.0, "sim-node-03": 70.0}
    run["hardware"] = {"gpu_temperature_celsius": {n: [[t, c] for t in ts]
                                                   for n, c in temps.items()}}
    d = diagnose(recording.to_view(run, "test"))
    thermal = next(f for f in d.findings if f.mode == "thermal_coupling")
    assert thermal.subject == {"node": "sim-node-00"} and thermal.confidence == 0.75
    assert any("sim-node-00 runs 10.0 °C hotter" in e["reading"]
               for e in thermal.evidence), thermal.evidence


def test_thermal_evidence_quotes_the_throttle_reasons_it_read():
    """The throttling in the evidence is the view's: its thermal reasons and hw_slowdown. The
    evidence quoted only the thermal ones, and pasted into Prometheus read a node slowed by
    hw_slowdown alone as never throttling."""
    run = recorded("straggler")
    ts = [s["t"] for s in run["steps"]]
    run["hardware"] = {
        "gpu_thermal_throttle": {f"sim-node-{n:02d}": [[t, 1.0 if n == 0 else 0.0] for t in ts] for n in range(4)},
    }
    thermal = next(f for f in diagnose(recording.to_view(run, "test")).findings if f.mode == "thermal_coupling")
    assert "hw_slowdown" in THERMAL_THROTTLE
    assert any(e["series"].startswith(THERMAL_THROTTLE + " and on (instance)") for e in thermal.evidence), \
        thermal.evidence


def test_straggler_on_a_throttling_node_without_the_skew_exchange_is_also_thermal():
    """The node of a straggler named from mean waits is checked against GPU telemetry as with the
    exchange; a straggling node moving between nodes is not looked for, and the notes say so."""
    run = recorded("straggler")
    ts = [s["t"] for s in run["steps"]]
    run["hardware"] = {
        "gpu_thermal_throttle": {f"sim-node-{n:02d}": [[t, 1.0 if n == 0 else 0.0] for t in ts] for n in range(4)},
    }
    d = diagnose(_without_skew_exchange(recording.to_view(run, "test")))
    modes = {f.mode: f for f in d.findings}
    assert set(modes) == {"straggler_persistent", "thermal_coupling"}
    assert modes["thermal_coupling"].subject == {"node": "sim-node-00"} and modes["thermal_coupling"].confidence >= 0.9
    assert ("no exact last arrivals (skew exchange off): a straggling node that moves between nodes not assessed; "
            "only a persistent straggler's node is checked against GPU telemetry") in d.notes


def test_congestion_counters_following_the_collective_raise_confidence():
    run = recorded("congestion")
    # IB transmit waits high exactly in the congested steps (collective well above its baseline)
    base = min(min(s["waits"]) for s in run["steps"])
    points = [[s["t"] + s["seconds"], 1e6 if min(s["waits"]) > 2 * base else 1e3] for s in run["steps"]]
    run["hardware"] = {"ib_xmit_wait_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
    (f,) = diagnose(recording.to_view(run, "test")).findings
    assert f.mode == "fabric_contention" and f.confidence >= 0.9
    assert any("correlation with collective time" in e["reading"] for e in f.evidence)


def slow_collective(step: dict) -> dict:
    """A recorded step whose collective took 40x longer: every rank waits that much more."""
    extra = 40 * min(step["waits"])
    step["waits"] = [w + extra for w in step["waits"]]
    step["seconds"] += extra
    return step


@pytest.mark.parametrize("counters", ["none", "flat"])
def test_contention_confidence_says_whether_fabric_counters_were_there_to_follow_it(counters):
    """Without congestion counters the contention rests on the collective time alone (0.65);
    counters in range that stay flat while the collective inflates speak against the fabric
    (0.5), and the evidence says they do not follow it."""
    run = recorded("congestion")
    if counters == "flat":
        points = [[s["t"] + s["seconds"], 1e3] for s in run["steps"]]
        run["hardware"] = {"ib_xmit_wait_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
    (f,) = diagnose(recording.to_view(run, "test")).findings
    assert f.mode == "fabric_contention"
    assert f.confidence == {"none": 0.65, "flat": 0.5}[counters]
    assert any(e["reading"] == "congestion counters do not follow the collective time"
               for e in f.evidence) == (counters == "flat")


def test_contention_in_most_steps_is_measured_against_its_quiet_windows():
    """Episodes of 70 of every 100 steps leave a fifth of the windows quiet: the baseline is the
    20th percentile of the windows' collective time, the true 150 ms, and the episodes read as
    their 4x; a higher percentile would fall inside the episodes and read them smaller."""
    truth = sim.run_scenario("congestion", nodes=4, ranks_per_node=8, seed=0,
                             params={"scheduled_congestion_steps": 70})
    run = recording.from_ground_truth(truth, start_wall=START)
    (f,) = diagnose(recording.to_view(run, "test")).findings
    assert f.mode == "fabric_contention"
    assert f.evidence[0]["value"] == pytest.approx(truth.params.collective_seconds, rel=1e-6)
    assert "(4.0x)" in f.evidence[1]["reading"], f.evidence[1]


def test_one_congested_step_is_no_fabric_contention():
    """A straggler job with one step whose collective took 40x longer, the fabric counters high in
    that step alone: one inflated window, over which the counters "correlate" (r = 1.00). It read
    as fabric contention at 0.9 beside the straggler; one event is no pattern."""
    run = recorded("straggler")
    steps = run["steps"]
    hit = slow_collective(steps[len(steps) // 2])
    points = [[s["t"] + s["seconds"], 1e6 if s is hit else 1e3] for s in steps]
    run["hardware"] = {"ib_xmit_wait_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
    d = diagnose(recording.to_view(run, "test"))
    assert [f.mode for f in d.findings] == ["straggler_persistent"]


@pytest.mark.parametrize("counters", ["none", "falling"])
def test_one_slow_window_among_few_is_no_fabric_contention(counters):
    """Eight windows, one of them slow (a step whose collective took 40x longer): one window is 12 %
    of them, past the 10 % share of inflated windows, and it read as fabric contention beside the
    straggler, at 0.65 without fabric counters and at 0.5 with counters that fell in that window
    (r = -1.00: in CI, a host stall on a loaded runner slowed one window of the thermal scenario,
    and its counter rates dropped). A share of windows is a pattern only over two of them."""
    run = recorded("straggler")
    steps = run["steps"]
    hit = slow_collective(steps[len(steps) // 2])
    if counters == "falling":
        points = [[s["t"] + s["seconds"], 1e3 if s is hit else 1e6] for s in steps]
        run["hardware"] = {"roce_congestion_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
    mean_step = sum(s["seconds"] for s in steps) / len(steps)
    v = recording.to_view(run, "test", min_window=len(steps) / 9 * mean_step)
    assert len([c for c in v.collective_series() if c is not None]) < 10  # one is >= 10 % of them
    assert [f.mode for f in diagnose(v).findings] == ["straggler_persistent"]
    slow_collective(steps[len(steps) // 2 + 2 * len(steps) // 9])  # another window slowed: episodes
    v = recording.to_view(run, "test", min_window=len(steps) / 9 * mean_step)
    assert [f.mode for f in diagnose(v).findings] == ["straggler_persistent", "fabric_contention"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("counters", [False, True])
def test_a_tiny_collective_inflating_is_no_fabric_contention(seed, counters):
    """A job on a loaded machine (3 % jitter: transient jitter idles 6 % of its rank-time) whose
    collective is 1 % of the step (0.2 ms in 20 ms) and doubles in episodes: the excess is 1 % of
    the step, nothing to act on, yet it read as fabric contention, at 0.9 with fabric counters
    following it, ahead of the jitter. The same episodes of a collective of 10 % of the step
    (a 10 % excess) still are contention."""
    def findings(collective: float) -> list[str]:
        run = recorded("congestion", seed, collective_seconds=collective, scheduled_congestion_factor=2.0,
                       jitter=0.03)
        if counters:
            base = min(min(s["waits"]) for s in run["steps"])
            points = [[s["t"] + s["seconds"], 1e6 if min(s["waits"]) > 1.5 * base else 1e3] for s in run["steps"]]
            run["hardware"] = {"ib_xmit_wait_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
        return [f.mode for f in diagnose(recording.to_view(run, "test")).findings]

    assert findings(0.01) == ["straggler_transient"]
    assert sorted(findings(0.1)) == ["fabric_contention", "straggler_transient"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_nodes_taking_last_arrivals_by_chance_are_no_rotating_straggler(seed):
    """Over two nodes one of them takes more than 60 % of a 10-step window's last arrivals by
    chance (62 % on average): a healthy 2 x 8 job read as thermal coupling, a straggling node
    rotating between its two nodes, and one with 8 % jitter (coupling 11 %) as thermal coupling
    instead of transient jitter. The thermal scenario's rotation still reads as thermal coupling."""
    def two_nodes(name, **params):
        truth = sim.run_scenario(name, nodes=2, ranks_per_node=8, seed=seed, params=params or None)
        return diagnose(recording.to_view(recording.from_ground_truth(truth, start_wall=START), "test"))

    healthy = two_nodes("healthy")
    assert healthy.findings == [] and healthy.verdict == "no structural problem found"
    assert [f.mode for f in two_nodes("healthy", jitter=0.08).findings] == ["straggler_transient"]
    if seed < 2:  # seed 2's nodes take 62 % of each window, as by chance: no rotation to tell
        (thermal,) = two_nodes("thermal").findings
        assert thermal.mode == "thermal_coupling" and len(thermal.subject["nodes"]) == 2


def thermal_telemetry(run: dict, nodes: int, ranks_per_node: int, seed: int) -> dict:
    """The GPU telemetry of the thermal scenario's nodes over ``run``'s steps, as the simulator's
    hardware model reads it (docs/simulator.md): heat h of each node's sinusoid, 65 + 20 h °C,
    thermal throttling while h >= 0.75."""
    from syncwatch.sim.model import Model
    p = sim.scenario_params("thermal", nodes, ranks_per_node)
    model = Model(p, seed)
    temps, throttle = {}, {}
    for st in run["steps"]:
        for n, f in enumerate(model.node_factors(st["step"])):
            h = (f - 1) / p.thermal_amplitude
            temps.setdefault(f"sim-node-{n:02d}", []).append([st["t"], 65.0 + round(20 * h)])
            throttle.setdefault(f"sim-node-{n:02d}", []).append([st["t"], 1.0 if h >= 0.75 else 0.0])
    return {"gpu_temperature_celsius": temps, "gpu_thermal_throttle": throttle}


@pytest.mark.parametrize(("nodes", "ranks_per_node"), [(16, 2), (32, 1)])
def test_a_rotating_straggling_node_over_many_nodes_is_thermal_when_its_gpus_throttle(nodes, ranks_per_node):
    """The thermal scenario over 16 x 2 and 32 x 1 ranks read as transient jitter (and fabric
    contention): the top node takes 47 % and 33 % of a window's last arrivals, below the 60 %
    node_dominates asks, however its GPUs throttle. The node arriving last most throttles in 90-100 %
    of windows where 26 % of nodes throttle: that carries thermal coupling now. The same telemetry
    over a healthy run (its last arrivals unrelated to it: 17-31 % of windows) reads no thermal."""
    for seed in (0, 1):
        truth = sim.run_scenario("thermal", nodes=nodes, ranks_per_node=ranks_per_node, seed=seed)
        run = recording.from_ground_truth(truth, start_wall=START)
        assert "thermal_coupling" not in {f.mode for f in diagnose(recording.to_view(run, "test")).findings}
        run["hardware"] = thermal_telemetry(run, nodes, ranks_per_node, seed)
        modes = {f.mode: f for f in diagnose(recording.to_view(run, "test")).findings}
        assert "thermal_coupling" in modes and "straggler_transient" not in modes, list(modes)
        thermal = modes["thermal_coupling"]
        assert thermal.confidence == 0.85 and len(thermal.subject["nodes"]) >= nodes // 2
        assert any("of windows the node arriving last most throttles then" in e["reading"] for e in thermal.evidence)
        healthy = recording.from_ground_truth(
            sim.run_scenario("healthy", nodes=nodes, ranks_per_node=ranks_per_node, seed=seed, steps=600),
            start_wall=START)
        healthy["hardware"] = thermal_telemetry(healthy, nodes, ranks_per_node, seed)
        assert "thermal_coupling" not in {f.mode for f in diagnose(recording.to_view(healthy, "test")).findings}


def test_a_cluster_throttling_everywhere_does_not_tell_which_node_straggles():
    """The thermal scenario over 16 x 2 and 32 x 1 ranks with every GPU throttling in every
    window (a hot room, a cluster-wide power cap): the node arriving last most throttles in every
    window, but so does every node, which is chance and no thermal cause of its straggling (the
    match must reach twice the share of nodes throttling)."""
    for nodes, ranks_per_node in ((16, 2), (32, 1)):
        truth = sim.run_scenario("thermal", nodes=nodes, ranks_per_node=ranks_per_node, seed=0)
        run = recording.from_ground_truth(truth, start_wall=START)
        run["hardware"] = thermal_telemetry(run, nodes, ranks_per_node, 0)
        throttle = run["hardware"]["gpu_thermal_throttle"]
        for node, points in throttle.items():
            throttle[node] = [[t, 1.0] for t, _ in points]
        d = diagnose(recording.to_view(run, "test"))
        assert "thermal_coupling" not in {f.mode for f in d.findings}, [f.title for f in d.findings]


def test_a_healthy_verdict_on_too_few_steps_says_so():
    """A recorded run of 8 steps read "no structural problem found", as a long healthy run does:
    so few steps rule nothing out, and the verdict and the notes now say it."""
    truth = sim.run_scenario("healthy", nodes=2, ranks_per_node=2, steps=8, seed=0)
    short = diagnose(recording.to_view(recording.from_ground_truth(truth, start_wall=START), "test"))
    assert short.healthy
    assert short.verdict == "no structural problem found in 8 steps, too few to rule any out: widen the range"
    assert any(n.startswith("only 8 steps in range") for n in short.notes), short.notes
    long = diagnose(recording.to_view(recorded("healthy"), "test"))
    assert long.verdict == "no structural problem found"
    assert not any(n.startswith("only ") for n in long.notes)


def test_a_range_far_longer_than_the_job_does_not_clear_it():
    """The congestion scenario read over a range 31 times its length (as --start now-24h reads a
    45-minute job): windows of 258 s, two of them with the job running through, and fabric
    contention needs four: it read "no structural problem found". The verdict and the notes now
    say what was not assessed, and the job's own range still finds the contention."""
    run = recorded("congestion")
    first, last = run["steps"][0]["t"], run["steps"][-1]["t"] + run["steps"][-1]["seconds"]
    wide = diagnose(recording.to_view(run, "test", first - 30 * (last - first), last))
    assert wide.healthy and wide.steps == 400
    assert wide.verdict == ("no structural problem found in what could be assessed: the job ran through 2 of "
                            "the range's windows, too few for fabric contention: narrow --start and --end to "
                            "the job")
    assert ("the job ran through 2 of the range's 60 windows of 258 s: fabric contention and topology mismatch "
            "need 4 and were not assessed; narrow --start and --end to the job") in wide.notes
    own = diagnose(recording.to_view(run, "test", first, last))
    assert [f.mode for f in own.findings] == ["fabric_contention"]
    assert not any("windows of" in n for n in own.notes)


def test_a_range_too_short_for_four_windows_is_told_to_widen():
    """A range the job ran through whole, cut into 3 windows (as --start now-70s reads a job of
    0.12 s steps, whose windows span four skew-exchange periods: 23 s), advised to "narrow --start
    and --end to the job", which leaves fewer windows still: it now says to widen the range."""
    run = recorded("healthy")
    first, last = run["steps"][0]["t"], run["steps"][-1]["t"] + run["steps"][-1]["seconds"]
    short = diagnose(recording.to_view(run, "test", first, last, min_window=(last - first) / 3))
    assert short.healthy and short.steps >= 100
    assert short.verdict == ("no structural problem found in what could be assessed: the job ran through 3 of "
                             "the range's windows, too few for fabric contention: widen the range")
    assert any(n.startswith("the job ran through 3 of the range's 3 windows of ")
               and n.endswith("were not assessed; widen the range") for n in short.notes), short.notes


def _without_skew_exchange(v):
    """The view as Prometheus gives it with the exact skew exchange off: no slack, no last arrivals."""
    for name in ("slack_seconds", "last_arrivals"):
        v.per_rank[name] = {r: [0.0] * len(row) for r, row in v.per_rank[name].items()}
    return v


def test_contention_without_the_skew_exchange_does_not_claim_arrival_spread_was_ruled_out():
    """With the exchange off the "collective time" is the whole sync wait, yet the finding said the
    collective itself slowed "while arrival spread (slack) did not explain it" (slack was never
    measured), at medium confidence."""
    with_slack = diagnose(recording.to_view(recorded("congestion"), "test")).findings
    (f,) = diagnose(_without_skew_exchange(recording.to_view(recorded("congestion"), "test"))).findings
    assert [g.mode for g in with_slack] == [f.mode] == ["fabric_contention"]
    text = " ".join([f.phenomenon, *(e["series"] + " " + e["reading"] for e in f.evidence)])
    assert "slack) did not explain" not in text and "not the ranks' arrival spread" not in text
    assert "cannot be told apart from late arrivals" in f.phenomenon
    assert f.evidence[0]["series"] == ("collective time per step (estimated) = smallest mean wait of the "
                                       "ranks (skew exchange off)")
    assert f.confidence_word == "low" and f.confidence == pytest.approx(with_slack[0].confidence - 0.2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_job_without_the_skew_exchange_is_not_said_to_be_free_of_what_was_not_measured(seed):
    """It read "no structural problem found" with a note that thermal causes were "inferred from
    arrival patterns", though without last arrivals neither jitter nor a straggling node moving
    between nodes had been looked at."""
    d = diagnose(_without_skew_exchange(recording.to_view(recorded("healthy", seed), "test")))
    assert d.healthy
    assert d.verdict == ("no structural problem found in what could be measured: without the skew exchange, "
                         "transient jitter and a straggling node that moves between nodes are not ruled out")
    assert d.to_dict()["verdict"] == d.verdict and f"  {d.verdict}" in summary(d).splitlines()
    assert not any("arrival patterns" in n for n in d.notes), d.notes
    assert any("transient jitter is not ruled out" in n for n in d.notes), d.notes
    assert any("thermal coupling not assessed" in n for n in d.notes), d.notes
    exact = diagnose(recording.to_view(recorded("healthy", seed), "test"))
    assert exact.verdict == "no structural problem found"


def test_a_straggler_appearing_without_the_skew_exchange_is_not_contention():
    """With the exchange off the collective time was the whole mean wait: a rank 15 % slower from
    mid-range raised every other rank's wait by its lateness, and the job read as fabric contention
    (no straggler named). The smallest mean wait is the straggler's own, which did not grow."""
    for seed in (0, 1, 2):
        v = _without_skew_exchange(recording.to_view(
            recorded("straggler", seed, straggler_from_step=150, straggler_slowdown=0.15), "test"))
        assert [(f.mode, f.subject) for f in diagnose(v).findings] == [
            ("straggler_persistent", {"rank": sim.straggler_rank(32), "node": "sim-node-00"})]


@pytest.mark.parametrize("name", sorted(set(SCENARIO_MODES) - {"thermal"}))
def test_without_the_skew_exchange_each_scenario_keeps_its_mode(name):
    """``thermal`` is left out: its straggling node rotates, which needs exact last arrivals."""
    d = diagnose(_without_skew_exchange(recording.to_view(recorded(name), "test")))
    assert {f.mode for f in d.findings} == SCENARIO_MODES[name], [f.title for f in d.findings]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_the_skew_exchange_a_persistent_straggler_is_named_from_mean_waits(seed):
    """It read as healthy: with no last-arrival counters the straggler was not looked for."""
    exact = diagnose(recording.to_view(recorded("straggler", seed), "test"))
    d = diagnose(_without_skew_exchange(recording.to_view(recorded("straggler", seed), "test")))
    (f,) = d.findings
    assert f.mode == "straggler_persistent" and f.subject == exact.findings[0].subject
    assert f.title == exact.findings[0].title
    assert "estimated from mean waits" in f.phenomenon
    assert not any(e["series"].startswith(("syncwatch_last_arrivals_total", "syncwatch_slack_seconds_total"))
                   for e in f.evidence), f.evidence
    # the smallest mean wait leads by the straggler's whole lateness: estimated ≈ exact coupling
    assert d.scores["coupling"] == pytest.approx(exact.scores["coupling"], rel=0.1)
    assert d.to_dict()["estimated"] == ["coupling", "straggler_concentration", "collective_seconds"]
    assert exact.to_dict()["estimated"] == []
    assert f.confidence == pytest.approx(exact.findings[0].confidence - 0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_the_skew_exchange_a_healthy_jobs_last_arrivals_are_shared_by_all_ranks(seed):
    """Healthy jitter keeps every rank's mean wait within a fraction of a per cent of the step of
    the smallest, so each window's steps are shared by all ranks (within 2 % of the step of it):
    the estimated concentration is 1/N, where the one rank with the smallest mean wait would
    take every window, and read as a straggler concentration many times it."""
    d = diagnose(_without_skew_exchange(recording.to_view(recorded("healthy", seed), "test")))
    assert d.scores["straggler_concentration"] == pytest.approx(1 / 32, rel=0.01)
    assert d.findings == []


def test_topology_mismatch_when_collective_grows_without_bytes_or_congestion():
    run = recorded("healthy")
    half = len(run["steps"]) // 2
    for s in run["steps"][half:]:  # second half: every wait +60 ms (collective slower), same bytes
        s["waits"] = [w + 0.06 for w in s["waits"]]
        s["seconds"] += 0.06
    points = [[s["t"], 5e9] for s in run["steps"]]
    run["hardware"] = {"net_bytes_rate": {f"sim-node-{n:02d}": points for n in range(4)}}
    modes = [f.mode for f in diagnose(recording.to_view(run, "test")).findings]
    assert "topology_mismatch" in modes
    (f,) = [f for f in diagnose(_without_skew_exchange(recording.to_view(run, "test"))).findings
            if f.mode == "topology_mismatch"]
    assert f.evidence[0]["series"].endswith("(estimated: smallest mean wait, skew exchange off)")


def test_rising_infiniband_congestion_is_not_hidden_by_flat_roce_counters():
    """A node exporting both kinds of congestion counters (an mlx5 HCA's hw_counters): the nodes'
    rows of both were summed under one key per node index, the RoCE rows replaced the IB ones,
    and transmit waits tripling with the collective time read as "without rising congestion
    counters": a topology mismatch instead of congestion."""
    run = recorded("healthy")
    half = len(run["steps"]) // 2
    for s in run["steps"][half:]:
        s["waits"] = [w + 0.06 for w in s["waits"]]
        s["seconds"] += 0.06
    mid = run["steps"][half]["t"]
    nodes = [f"sim-node-{n:02d}" for n in range(4)]
    run["hardware"] = {
        "net_bytes_rate": {n: [[s["t"], 5e9] for s in run["steps"]] for n in nodes},
        "ib_xmit_wait_rate": {n: [[s["t"], 3e5 if s["t"] >= mid else 1e5] for s in run["steps"]] for n in nodes},
        "roce_congestion_rate": {n: [[s["t"], 2.0] for s in run["steps"]] for n in nodes},
    }
    assert "topology_mismatch" not in {f.mode for f in diagnose(recording.to_view(run, "test")).findings}
    del run["hardware"]["ib_xmit_wait_rate"]  # the same job with only the flat counters is one
    assert "topology_mismatch" in {f.mode for f in diagnose(recording.to_view(run, "test")).findings}


def test_a_partial_window_holding_lagged_slack_is_not_contention():
    """Slack lands once per exchange, the waits every step: a window the job ran through only in
    part (here the range's last: one step) can hold the earlier steps' slack, so sync − slack is
    near zero there. Among a few windows that would set a baseline every full window exceeds."""
    truth = sim.run_scenario("oscillation", nodes=4, ranks_per_node=8, steps=60, seed=0)
    v = recording.to_view(recording.from_ground_truth(truth, start_wall=START), "test")
    last = len(v.times) - 1
    for r in v.ranks:
        n = v.per_rank["steps"][r][last]
        for name in ("steps", "step_seconds", "sync_seconds"):
            v.per_rank[name][r][last] /= n
        v.per_rank["slack_seconds"][r][last] = 0.98 * v.per_rank["sync_seconds"][r][last]
    coll = v.collective_series()
    assert coll[last] is None and all(c == pytest.approx(0.15, rel=0.01) for c in coll[:last]), coll
    assert {f.mode for f in diagnose(v).findings} == {"oscillation"}


def test_a_restart_in_the_first_window_is_in_range():
    """A range begun a few seconds before a restart (zooming in on the incident) holds it: the
    restarts were counted from the end of the first window, and this range read as healthy."""
    run = recorded("restarts")
    first = run["restarts"][0]
    v = recording.to_view(run, "test", first["t"] - 3, first["t"] + 120)
    assert v.times[0] > first["t"]  # the restart lies inside the first window
    d = diagnose(v)
    assert (d.scores["restarts"], d.scores["rerun_steps"]) == (1, first["failed_step"] - first["resume_step"] + 1)
    assert [f.mode for f in d.findings] == ["checkpoint_restart"]


def test_the_mtbf_counts_the_time_the_job_ran_not_the_range_around_it():
    """A range begun long before the job (the default hour, a job 20 minutes old) divided the
    whole range by the restarts: the MTBF, and Young's checkpoint interval from it, read long."""
    run = recorded("restarts")
    first, last = run["steps"][0], run["steps"][-1]
    ran = last["t"] + last["seconds"] - first["t"]

    def mtbf(start):
        d = diagnose(recording.to_view(run, "test", start, last["t"] + last["seconds"]))
        (f,) = [f for f in d.findings if f.mode == "checkpoint_restart"]
        reading = next(e["reading"] for e in f.evidence if "observed MTBF" in e["reading"])
        return float(reading.split("observed MTBF ")[1].split(" min")[0]), d.scores["restarts"]

    minutes, restarts = mtbf(first["t"])
    assert minutes == pytest.approx(ran / restarts / 60, abs=0.1)
    longer, again = mtbf(first["t"] - 3 * ran)  # coarser windows: the job's edges within one
    assert again == restarts and longer == pytest.approx(minutes, rel=0.05)


def test_a_recorded_checkpoint_costs_its_steps_checkpoint_time():
    """A recorded step's checkpoint is global rank 0's time (as the daemon counts it): a checkpoint
    costs the mean of the steps that hold one, not a share of it per rank."""
    run = recorded("restarts")
    saves = [s["checkpoint"] for s in run["steps"] if s["checkpoint"] > 0]
    (f,) = [f for f in diagnose(recording.to_view(run, "test")).findings if f.mode == "checkpoint_restart"]
    (cost,) = [e for e in f.evidence if "a checkpoint costs" in e["reading"]]
    assert len(saves) >= 2 and cost["value"] == pytest.approx(sum(saves) / len(saves), abs=1e-3)
    assert f"{len(saves)} in range" in cost["reading"]


def test_a_recorded_runs_step_cv_is_the_daemons():
    """A recorded run's step CV and autocorrelation are what the daemons' gauges read: over the
    last 100 steps of the attempt, from its processes' second step, each less its checkpoint, the
    steps before the range included. They were taken over the range's own steps with their
    checkpoints: the restarts scenario (a 0.5 s save every 50 steps of 1.2 s) read a step CV of
    6.0 % at its end where its daemons read 0.6 %, and 7.6 % over its last 30 steps."""
    truth = sim.run_scenario("restarts", nodes=4, ranks_per_node=8, seed=0)
    run = recording.from_ground_truth(truth, start_wall=START)
    for start in (None, run["steps"][-30]["t"]):
        v = recording.to_view(run, "test", start)
        assert v.cv[-1] == pytest.approx(truth.cv(), rel=1e-9)
        assert v.autocorrelation[-1] == pytest.approx(truth.autocorrelation(), rel=1e-9)
    assert diagnose(recording.to_view(run, "test")).scores["step_cv"] == pytest.approx(truth.cv(), rel=0.1)


@pytest.mark.parametrize(("seed", "steps"), [(4, 4), (2, 9)])
def test_a_few_steps_after_a_restart_are_no_oscillation(seed, steps):
    """The restarts scenario read right after its first restart: the daemons' autocorrelation then
    rests on the new processes' few steps, where noise alone reads -0.5 or below in a fifth of
    4-step windows; 4 steps read -0.66 (seed 4) and 9 steps -0.61 (seed 2), both reported as
    oscillation. A window's autocorrelation now counts from 20 steps: the range says oscillation
    was not assessed, and the oscillation scenario read from its start still finds it in 22."""
    run = recording.from_ground_truth(sim.run_scenario("restarts", nodes=4, ranks_per_node=8, seed=seed),
                                      start_wall=START)
    after = [s for s in run["steps"] if s["t"] >= run["restarts"][0]["t"]][:steps]
    d = diagnose(recording.to_view(run, "test", after[0]["t"], after[-1]["t"] + after[-1]["seconds"]))
    assert "oscillation" not in {f.mode for f in d.findings}
    assert d.scores["step_autocorrelation"] is None
    assert ("no step-time autocorrelation in range that rests on 20 steps (a process's first 20 after its start "
            "or a restart are too few): oscillation not assessed") in d.notes
    osc = recorded("oscillation", seed)
    first, last = osc["steps"][0], osc["steps"][21]
    d = diagnose(recording.to_view(osc, "test", first["t"], last["t"] + last["seconds"]))
    assert [f.mode for f in d.findings] == ["oscillation"]
    assert not any("oscillation not assessed" in n for n in d.notes)


def test_a_weak_alternation_is_no_oscillation():
    """The oscillation scenario at a twentieth of its amplitude (compute x 1.005 / x 0.995 under
    1.5 % jitter) reads a lag-1 autocorrelation around -0.35: a hint of rhythm, not the strongly
    negative -0.5 or below of an oscillation; at 1 % it reads below -0.5 and is one."""
    weak = diagnose(recording.to_view(recorded("oscillation", oscillation=0.005), "test"))
    assert -0.5 < weak.scores["step_autocorrelation"] < -0.2 and weak.findings == []
    strong = diagnose(recording.to_view(recorded("oscillation", oscillation=0.01), "test"))
    assert strong.scores["step_autocorrelation"] <= -0.5
    assert [f.mode for f in strong.findings] == ["oscillation"]


def test_window_sets_a_recorded_runs_windows(tmp_path, monkeypatch):
    """``--window`` was read from Prometheus only: a recorded run was cut into windows of 10 mean
    steps whatever it asked (reports at --window 15, 100 and 300 were the same file). It is now
    the shortest window there too, never fewer than 10 mean steps."""
    from syncwatch import cli
    from syncwatch.analysis.source import view_from_args
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"diagnose": cli.SUBCOMMANDS["diagnose"]})
    run = recorded("healthy")
    path = tmp_path / "run.json"
    recording.save(run, path)

    def view(*flags):
        return view_from_args(cli.build_parser().parse_args(["diagnose", "--input", str(path), *flags]))[0]

    mean_step = sum(s["seconds"] for s in run["steps"]) / len(run["steps"])
    default = view()
    span = default.end - default.start
    assert default.window == pytest.approx(span / int(span // (10 * mean_step)))
    wide = view("--window", "100")
    assert wide.window >= 100 and len(wide.times) == int(span // 100)
    assert view("--window", "1").window == default.window  # never fewer than 10 mean steps
    monkeypatch.setenv("SYNCWATCH_ANALYSIS_WINDOW", "100")
    assert view().window == wide.window


def test_cli_offline_json_and_summary(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.json"
    recording.save(recorded("restarts"), path)
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path), "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["verdict"] == "1 structural problem found"
    assert data["findings"][0]["mode"] == "checkpoint_restart"
    assert {"phenomenon", "evidence", "cause", "options", "confidence"} <= set(data["findings"][0])
    recording.save(recorded("healthy"), path)
    code, out, _ = run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path)])
    assert code == 0 and "no structural problem found" in out


def test_counts_agree_with_their_nouns(tmp_path, monkeypatch, capsys):
    """A one-rank job read "1 ranks on 1 nodes" (diagnose, report), a two-rank straggler "the other 1 ranks wait for
    it", and a finding "1 structural problem(s) found" after "restarted 2 time(s)"."""
    path = tmp_path / "run.json"
    truth = sim.run_scenario("restarts", nodes=1, ranks_per_node=1, seed=0)
    recording.save(recording.from_ground_truth(truth, start_wall=START), path)
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path)])
    assert code == 0, err
    assert out.startswith(f"syncwatch diagnose: train job sim-restarts — 1 rank on 1 node, {len(truth.steps)} steps")
    assert f"The job restarted {len(truth.restarts)} times and re-ran" in out and "(s)" not in out
    data = run_json(monkeypatch, capsys, ["diagnose", "--input", str(path)])
    assert data["verdict"] == "1 structural problem found"
    html = tmp_path / "report.html"
    code, _, err = run_cli(monkeypatch, capsys, ["report", "--input", str(path), "--output", str(html)])
    assert code == 0 and '<p class="meta">1 rank on 1 node · ' in html.read_text(), err
    recording.save(recording.from_ground_truth(sim.run_scenario("straggler", nodes=1, ranks_per_node=2, seed=0),
                                               start_wall=START), path)
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path)])
    assert code == 0 and "— 2 ranks on 1 node," in out, err
    assert "the other rank waits for it" in out and "1 ranks" not in out


@pytest.mark.parametrize(("flag", "lo", "hi"), [("--end", -math.inf, START + 120), ("--start", START + 120, math.inf)])
def test_a_recorded_run_cut_at_one_end_only(tmp_path, monkeypatch, capsys, flag, lo, hi):
    """``--end`` alone on a recorded run took the default ``--start now-1h`` with it, a start long
    after the run: "no step ends in the time range (empty range)". A bound not given leaves the
    run's own edge."""
    path = tmp_path / "run.json"
    run = recorded("straggler")
    recording.save(run, path)
    cut = START + 120
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path), "--json", flag, f"{cut:.0f}"])
    assert code == 0, err
    expected = sum(1 for s in run["steps"] if lo <= s["t"] + s["seconds"] <= hi)
    assert 0 < expected < len(run["steps"]) and json.loads(out)["steps"] == expected


@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_given_start_applies_to_a_recorded_run_whatever_its_value(tmp_path, monkeypatch, capsys, given):
    """``--start now-1h`` (or ``SYNCWATCH_START=now-1h``) on a run recorded three hours ago read
    as not given, because its value is Prometheus' default: all 300 steps, where ``now-2h`` was
    "empty range". A bound given, as the flag or its twin, applies as given; where it leaves no
    step, the error names it and when the run's steps ended."""
    path = tmp_path / "run.json"
    start = time.time() - 3 * 3600
    truth = sim.run_scenario("healthy", nodes=2, ranks_per_node=2, seed=0)
    recording.save(recording.from_ground_truth(truth, start_wall=start), path)

    def diagnose_from(value: str) -> tuple[int, str, str]:
        if given == "env":
            monkeypatch.setenv("SYNCWATCH_START", value)
            return run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path), "--json"])
        return run_cli(monkeypatch, capsys, ["diagnose", "--input", str(path), "--json", "--start", value])

    code, out, err = diagnose_from("now-1h")
    named = "--start now-1h" if given == "flag" else "SYNCWATCH_START=now-1h"
    assert code == 2 and not out, err
    assert err.startswith(f"syncwatch diagnose: error: {path}: no step of 'sim-healthy' ends between ")
    assert f"({named}) and the run's last step (empty range): its steps end between " in err
    assert err.rstrip().endswith("a time relative to now counts from now, not from the recording")
    code, out, err = diagnose_from("now-4h")
    assert code == 0 and json.loads(out)["steps"] == len(truth.steps), err


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path, json_flag):
    """``syncwatch diagnose ... | head`` ended in a BrokenPipeError traceback (exit 1) once head
    had read its lines; now the command stops without a word, with SIGPIPE's status 141. The pipe's
    read end is closed before the command starts, so its first write finds no reader."""
    path = tmp_path / "run.json"
    recording.save(recorded("restarts"), path)
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "syncwatch", "diagnose", "--input", str(path), *json_flag],
                              stdout=write, stderr=subprocess.PIPE, text=True, env=subprocess_env(), timeout=60)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def _broken(run: dict, where: str) -> dict:
    run = json.loads(json.dumps(run))
    if where == "null wait":
        run["steps"][5]["waits"][3] = None
    elif where == "NaN wait":
        run["steps"][5]["waits"][3] = float("nan")   # json writes NaN, and reads it back
    elif where == "negative wait":
        run["steps"][5]["waits"][3] = -0.1
    elif where == "infinite seconds":
        run["steps"][5]["seconds"] = float("inf")
    elif where == "text checkpoint":
        run["steps"][5]["checkpoint"] = "5s"
    elif where == "zero seconds":
        run["steps"][5]["seconds"] = 0.0
    elif where == "wait longer than the step":
        run["steps"][5]["waits"][3] = run["steps"][5]["seconds"] * 5
    elif where == "checkpoint longer than the step":
        run["steps"][5]["checkpoint"] = run["steps"][5]["seconds"] + 1
    elif where == "restart without resume_step":
        del run["restarts"][0]["resume_step"]
    elif where == "text samples_per_step":
        run["samples_per_step"] = "32"
    elif where == "hardware as a list":
        run["hardware"] = {"gpu_temperature_celsius": [[1.7e9, 70.0]]}
    elif where == "rank_node as text":
        run["rank_node"] = "sim-node-00"
    elif where == "null job":
        run["job"] = None
    elif where == "numeric job":
        run["job"] = 42
    return run


@pytest.fixture(scope="module")
def restarts_run() -> dict:
    return recorded("restarts")


STEP_5 = "step #5 (step 6)"  # the sixth step in the file is the run's step 6


@pytest.mark.parametrize(("where", "field"), [
    ("null wait", STEP_5), ("NaN wait", STEP_5), ("negative wait", STEP_5),
    ("infinite seconds", STEP_5), ("text checkpoint", STEP_5), ("restart without resume_step", "restart #0"),
    # a step of 0 s was a ZeroDivisionError in project and report; a wait or a checkpoint longer
    # than its step read a sync tax above 100 %
    ("zero seconds", STEP_5), ("wait longer than the step", STEP_5), ("checkpoint longer than the step", STEP_5),
    ("text samples_per_step", "samples_per_step"), ("hardware as a list", "hardware"),
    ("rank_node as text", "rank_node"),
    # the report escaped the name (AttributeError: 'NoneType' object has no attribute 'replace')
    ("null job", "job"), ("numeric job", "job")])
@pytest.mark.parametrize("command", ["diagnose", "project", "report"])
def test_a_malformed_recording_is_one_line_naming_the_field(restarts_run, tmp_path, monkeypatch, capsys, where, field,
                                                           command):
    """Each of these was a traceback (TypeError, KeyError, AttributeError; a NaN wait a ValueError
    from the JSON output of project) or, for an infinite step, NaN figures."""
    path = tmp_path / "run.json"
    recording.save(_broken(restarts_run, where), path)
    extra = ["--output", str(tmp_path / "r.html")] if command == "report" else []
    code, out, err = run_cli(monkeypatch, capsys, [command, "--input", str(path), *extra])
    assert code == 2 and err.startswith(f"syncwatch {command}: error: --input {path}: {field} is malformed"), err
    assert not out and len(err.splitlines()) == 1


def test_steps_recorded_out_of_order_are_read_in_order(tmp_path):
    run = recorded("straggler")
    path = tmp_path / "run.json"
    recording.save({**run, "steps": run["steps"][::-1]}, path)
    ordered = diagnose(recording.to_view(run, "test")).to_dict()
    shuffled = diagnose(recording.to_view(recording.load(path), "test")).to_dict()
    assert shuffled == ordered


def test_cli_errors_exit_2(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.json"
    recording.save(recorded("healthy"), path)
    cases = [
        (["--input", str(tmp_path / "nope.json")], "cannot read --input"),
        (["--input", str(path), "--job", "other"], "unknown train job 'other'"),
        (["--input", str(path), "--start", "100", "--end", "200"], "empty range"),
        ([], "give --prometheus URL"),
        (["--prometheus", "http://127.0.0.1:9", "--job", "x"], "Prometheus unreachable"),
        (["--prometheus", "http://127.0.0.1:9"], "--job"),
        # non-finite numbers were tracebacks (ValueError: cannot convert float NaN to integer)
        (["--prometheus", "http://127.0.0.1:9", "--job", "x", "--window", "nan"], "--window must be a positive"),
        (["--prometheus", "http://127.0.0.1:9", "--job", "x", "--window", "0"], "--window must be a positive"),
        (["--prometheus", "http://127.0.0.1:9", "--job", "x", "--start", "nan"], "cannot read time 'nan'"),
        (["--prometheus", "http://127.0.0.1:9", "--job", "x", "--end", "inf"], "cannot read time 'inf'"),
        # said "end 1795821600 is not after start 1795821660": raw seconds, where the other
        # messages give times as RFC 3339
        (["--prometheus", "http://127.0.0.1:9", "--job", "x", "--start", "1795821660", "--end", "1795821600"],
         f"empty time range: --end {fmt_time(1795821600)} is not after --start {fmt_time(1795821660)}"),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    cases.append((["--input", str(bad)], "is not a recorded run"))
    for argv, message in cases:
        code, out, err = run_cli(monkeypatch, capsys, ["diagnose", *argv])
        assert code == 2 and message in err, (argv, err)


@pytest.mark.parametrize("env, argv, says", [
    ({"SYNCWATCH_ANALYSIS_WINDOW": "0"}, ["--prometheus", "http://127.0.0.1:9", "--job", "x"],
     "--window (from SYNCWATCH_ANALYSIS_WINDOW) must be a positive number of seconds (got 0.0)"),
    ({"SYNCWATCH_PROMETHEUS_TIMEOUT": "nan"}, ["--prometheus", "http://127.0.0.1:9", "--job", "x"],
     "--prometheus-timeout (from SYNCWATCH_PROMETHEUS_TIMEOUT) must be a positive number of "
     "seconds (got nan)"),
    ({"SYNCWATCH_PROMETHEUS": "http://127.0.0.1:9"}, ["--input", "run.json"],
     "give either --prometheus (from SYNCWATCH_PROMETHEUS) or --input, not both"),
])
def test_cli_errors_name_the_variable_a_value_came_from(env, argv, says, monkeypatch, capsys):
    """Each named the flag alone: a SYNCWATCH_PROMETHEUS exported for another job refused an
    --input run with "give either --prometheus or --input", though no --prometheus was typed."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", *argv])
    assert code == 2 and f"error: {says}" in err and not out, err
