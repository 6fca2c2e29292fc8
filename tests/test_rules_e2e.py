"""End to end on loopback: simulator -> daemons -> Prometheus -> Alertmanager -> webhook.

Four train jobs share two real daemons: one healthy, one whose step-time variance grows (the
simulator's congestion episodes), one with a persistent straggler (rank 5 on sim-node-01), one
that stalls (a rank hangs; all keep heartbeating); they run the skew exchange every 10 steps. A
second drill runs a healthy and a straggler job without it (K = 0). Rules are the shipped ones rendered at time
scale 0.05 (5m windows -> 15s); Alertmanager runs the shipped routing with fast timers.
Detection latency is measured by benchmarks/detection_latency.py, not asserted here.
"""

from __future__ import annotations

import shutil

import pytest

from syncwatch.rules.drill import EXPECTED, run_drill, straggler_node

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus missing (Debian package: prometheus)"),
    pytest.mark.skipif(shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
                       reason="Alertmanager missing (Debian package: prometheus-alertmanager)"),
]


@pytest.fixture(scope="module")
def drill():
    return run_drill(timeout=190)


def test_every_fault_pages_its_alert_after_the_fault_started(drill):
    for job in drill.jobs.values():
        if job.fault not in EXPECTED:
            continue
        name = EXPECTED[job.fault]
        assert name in job.notified, f"{job.fault}: {name} never notified; firing: {job.firing}"
        assert job.receivers[name] == "pager"
        assert job.onset < job.firing[name] <= job.notified[name] + 1.0
        labels = job.notified_alerts[name]["labels"]
        assert labels["train_job"] == job.job and labels["severity"] == "critical"


def test_the_straggler_page_names_the_right_rank_and_node(drill):
    alert = drill.jobs["drill-straggler"].notified_alerts["SyncwatchPersistentStraggler"]
    assert alert["labels"]["rank"] == "5"
    assert alert["labels"]["node"] == straggler_node() == "sim-node-01"
    assert alert["annotations"]["description"].startswith("Rank 5 on node sim-node-01 arrived last")
    assert alert["annotations"]["runbook_url"].endswith("#syncwatchpersistentstraggler")


def test_the_healthy_job_pages_nothing_and_fires_nothing(drill):
    healthy = drill.jobs["drill-healthy"]
    assert healthy.firing == {} and healthy.notified == {}
    assert drill.duration > 60  # it was watched longer than the slowest alert needed to fire


def test_one_stall_in_a_job_of_slow_steps_goes_pending_and_pages_nothing(drill):
    """10 s steps (at time scale 1) and one 30 s stall: the variance alert goes pending, and the
    daemon's CV, over the last 4 minutes of steps, lets the stall go before the alert's 10m.
    Over W = 100 steps (17 minutes) it paged ~13 minutes after the stall."""
    job = drill.jobs["drill-one-stall"]
    assert "SyncwatchStepTimeVarianceGrowing" in job.pending
    assert job.pending["SyncwatchStepTimeVarianceGrowing"] > job.onset
    assert job.firing == {} and job.notified == {}
    assert drill.duration > 60 + 20 * 60 * 0.05  # watched 20 minutes after the stall


def test_the_stalled_job_pages_only_the_stall(drill):
    """One rank hangs in its compute while the others wait in the step's collective. The job
    stalls; and the hung rank, which never entered that collective, is one behind the others'
    collective sequence for good: SyncwatchRankDesynchronized, which names it, may page too (it
    needs longer than the stall: 5m without a collective, then its 2m). Nothing else pages."""
    stall = drill.jobs["drill-stall"]
    assert "SyncwatchJobStalled" in stall.notified
    assert set(stall.notified) <= {"SyncwatchJobStalled", "SyncwatchRankDesynchronized"}
    if "SyncwatchRankDesynchronized" in stall.notified:
        labels = stall.notified_alerts["SyncwatchRankDesynchronized"]["labels"]
        assert (labels["rank"], labels["node"]) == ("2", "sim-node-00")


def test_the_job_stuck_before_its_first_step_pages_only_that(drill):
    start = drill.jobs["drill-start"]
    assert set(start.notified) == {"SyncwatchJobStuckAtStart"}
    # its for: 30m at the drill's time scale, counted from the ranks' first reports
    assert start.firing["SyncwatchJobStuckAtStart"] - start.onset >= 30 * 60 * 0.05


def test_instability_score_separates_healthy_from_degraded_on_the_real_pipeline(drill):
    s = drill.scores
    assert s["drill-healthy"] < 0.2
    assert s["drill-variance"] > 0.5 and s["drill-straggler"] > 0.5


def test_only_critical_alerts_reach_the_pager(drill):
    for note in drill.notifications:
        if note["receiver"] == "pager":
            assert {a["labels"]["severity"] for a in note["payload"]["alerts"]} == {"critical"}


@pytest.fixture(scope="module")
def drill_without_exchange():
    return run_drill(faults=("healthy", "straggler"), exchange_every=0, timeout=190)


def test_without_the_skew_exchange_the_straggler_still_pages_and_the_healthy_job_does_not(
        drill_without_exchange):
    """K = 0: no slack, last-arrival or skew series; the rules estimate them from mean waits."""
    d = drill_without_exchange
    straggler, healthy = d.jobs["drill-straggler"], d.jobs["drill-healthy"]
    alert = straggler.notified_alerts["SyncwatchPersistentStraggler"]
    assert straggler.receivers["SyncwatchPersistentStraggler"] == "pager"
    assert straggler.onset < straggler.firing["SyncwatchPersistentStraggler"]
    assert (alert["labels"]["rank"], alert["labels"]["node"]) == ("5", straggler_node())
    assert healthy.firing == {} and healthy.notified == {}
    assert d.duration > 60
    assert d.scores["drill-healthy"] < 0.2 and d.scores["drill-straggler"] > 0.5
