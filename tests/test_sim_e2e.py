"""Simulator -> real daemons (one per simulated node) -> HTTP scrape: the exposition tells the truth.

Also the golden exposition of a fixed simulated scenario. Regenerate it after an intended change
with ``SYNCWATCH_UPDATE_GOLDEN=1 python -m pytest tests/test_sim_e2e.py`` and review the diff.
"""

import math
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from syncwatch.daemon.app import DaemonThread
from syncwatch.daemon.config import DaemonConfig
from syncwatch.protocol import PHASES
from syncwatch.sim.driver import node_name
from syncwatch.sim.model import step_cv
from syncwatch.sim.scenarios import run_scenario, straggler_rank

GOLDEN = Path(__file__).parent / "golden" / "sim_straggler_2x2.prom"
UPDATE_GOLDEN = os.environ.get("SYNCWATCH_UPDATE_GOLDEN", "").lower() in ("1", "true", "yes")
START = 1_700_000_000.0
PREFIX = "sim-node-"


@pytest.fixture
def cluster():
    """``start(nodes)`` -> one running daemon per simulated node, each on its own socket and port."""
    started = []
    d = tempfile.mkdtemp(prefix="sw-e2e-")

    def start(nodes: int, **config):
        for n in range(nodes):
            cfg = DaemonConfig(listen="127.0.0.1:0", socket=os.path.join(d, f"n{n}.sock"), **config)
            daemon = DaemonThread(cfg)
            daemon.start()
            started.append(daemon)
        return started

    yield start
    for daemon in started:
        daemon.stop()


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(sm: dict, name: str, **labels) -> float:
    return sm[(name, frozenset((k, str(v)) for k, v in labels.items()))]


def scrape_when_ingested(daemons, per_daemon: int, timeout: float = 30.0) -> list[dict]:
    """Scrape every daemon once each has accepted ``per_daemon`` records."""
    end = time.monotonic() + timeout
    while True:
        got = [samples(scrape_text(d.url)) for d in daemons]
        counts = [value(sm, "syncwatch_ingest_records_total") for sm in got]
        if all(c >= per_daemon for c in counts) or time.monotonic() > end:
            assert counts == [per_daemon] * len(daemons)
            return got
        time.sleep(0.05)


def run_through(daemons, name, nodes, rpn, steps, **kw):
    truth = run_scenario(name, nodes, rpn, steps, sockets=[d.socket_path for d in daemons],
                         start_wall=START, **kw)
    assert truth.dropped == 0
    return truth, scrape_when_ingested(daemons, truth.records_sent // nodes)


def test_exported_totals_equal_the_simulators_truth(cluster):
    nodes, rpn = 4, 8
    daemons = cluster(nodes)
    truth, scraped = run_through(daemons, "straggler", nodes, rpn, 300)
    job = truth.job
    window_cv, window_ac = truth.cv(100), truth.autocorrelation(100)  # W = 100 steps (DESIGN.md)
    exported_last = {}
    for g in range(nodes * rpn):
        n = g // rpn
        sm = scraped[n]
        rep = truth.reported[g]
        lab = dict(train_job=job, rank=g)
        assert value(sm, "syncwatch_steps_total", **lab) == rep.steps == 300
        assert value(sm, "syncwatch_step_seconds_total", **lab) == pytest.approx(rep.step_seconds, rel=1e-12)
        for k, phase in enumerate(PHASES):
            assert value(sm, "syncwatch_phase_seconds_total", phase=phase, **lab) == pytest.approx(
                rep.phase_seconds[k], rel=1e-12, abs=1e-12)
        assert value(sm, "syncwatch_samples_total", **lab) == rep.samples
        # exact slack and last arrivals: the model's per-step truth, summed over the whole run
        assert value(sm, "syncwatch_slack_seconds_total", **lab) == pytest.approx(truth.slack_seconds[g], rel=1e-9)
        exported_last[g] = value(sm, "syncwatch_last_arrivals_total", **lab)
        assert exported_last[g] == truth.last_arrivals[g]
        assert value(sm, "syncwatch_step_cv", **lab) == pytest.approx(window_cv, rel=1e-9)
        assert value(sm, "syncwatch_step_autocorrelation", **lab) == pytest.approx(window_ac, rel=1e-9)
        assert value(sm, "syncwatch_last_step", **lab) == 300
        # a rank's series live on its own node's daemon only
        for other in range(nodes):
            if other != n:
                assert ("syncwatch_steps_total", frozenset((k, str(v)) for k, v in lab.items())) \
                    not in scraped[other]
    ranked = sorted(exported_last.values(), reverse=True)
    s = straggler_rank(nodes * rpn)
    assert exported_last[s] == ranked[0] >= 0.95 * 281  # late from step 20 to 300
    assert ranked[0] > 10 * ranked[1], "the injected straggler has by far the most last arrivals"
    skew_count = value(scraped[0], "syncwatch_barrier_skew_seconds_count", train_job=job)
    skew_sum = value(scraped[0], "syncwatch_barrier_skew_seconds_sum", train_job=job)
    assert skew_count == 300
    assert skew_sum == pytest.approx(sum(st.skew for st in truth.steps), rel=1e-9)
    assert sum(value(sm, "syncwatch_ingest_records_total") for sm in scraped) == truth.records_sent
    for sm in scraped:
        assert not [k for k in sm if k[0] == "syncwatch_ingest_rejected_total" and sm[k] > 0]
        assert value(sm, "syncwatch_client_dropped_records_total") == 0


def test_restarts_reach_the_job_series(cluster):
    daemons = cluster(2)
    truth, scraped = run_through(daemons, "restarts", 2, 2, 400)
    sm = scraped[0]  # global rank 0's node
    job = truth.job
    assert value(sm, "syncwatch_job_attempt", train_job=job) == 2
    assert value(sm, "syncwatch_job_restarts_total", train_job=job) == len(truth.restarts) == 2
    assert value(sm, "syncwatch_job_rerun_steps_total", train_job=job) == truth.rerun_steps == 40
    # counters of the current processes, the attempt-2 pids on rank_info
    assert value(sm, "syncwatch_steps_total", train_job=job, rank=0) == truth.reported[0].steps == 110
    pids = {dict(k[1])["pid"] for k in sm if k[0] == "syncwatch_rank_info"}
    assert pids == {str(100_000 + 2 * 65_536 + r) for r in (0, 1)}
    # the truth's CV is the daemon's: the current processes' steps, checkpoints (300, 350) not
    # counted as jitter; with them it read ~7x the exported value
    for rank in (0, 1):
        lab = dict(train_job=job, rank=rank)
        assert value(sm, "syncwatch_step_cv", **lab) == pytest.approx(truth.cv(100), rel=1e-9)
        assert value(sm, "syncwatch_step_autocorrelation", **lab) == pytest.approx(
            truth.autocorrelation(100), rel=1e-9)


def test_evaluations_are_exported_as_eval_and_left_out_of_the_cv(cluster):
    """An evaluation of 20 step times every 40 steps: exported as the eval phase on every rank,
    whole in the step counters, and left out of the CV (a planned pause): the daemon's CV is the
    truth's, a few percent, where the evaluations counted in read it above 1."""
    daemons = cluster(1)
    truth, scraped = run_through(daemons, "healthy", 1, 2, 200,
                                 params=dict(eval_every=40, eval_seconds=20.0), keep_steps=True)
    sm, job = scraped[0], truth.job
    evals = [st.step for st in truth.steps if st.phases[0][PHASES.index("eval")] > 0]
    assert evals == [40, 80, 120, 160, 200]
    for rank in (0, 1):
        lab = dict(train_job=job, rank=rank)
        assert value(sm, "syncwatch_phase_seconds_total", phase="eval", **lab) == pytest.approx(
            truth.reported[rank].phase_seconds[PHASES.index("eval")], rel=1e-12) == 100.0
        assert value(sm, "syncwatch_step_seconds_total", **lab) > 100.0 + 160
        cv = value(sm, "syncwatch_step_cv", **lab)
        assert cv == pytest.approx(truth.cv(100), rel=1e-9)
        assert cv < 0.1
    assert step_cv([st.step_seconds for st in truth.steps[-100:]]) > 1


def test_a_checkpoint_on_rank_0_alone_is_its_peers_sync(cluster):
    """Rank 0 saves 20 step times every 40 steps while rank 1 waits for it in the collective:
    rank 1 counts the save as sync and its CV holds it (above 1), rank 0's leaves it out (the
    truth's, a few percent): the job's CV is its least disturbed rank's
    (``train_job:syncwatch_step_cv:min``). Nor is the save slack or skew."""
    daemons = cluster(1)
    truth, scraped = run_through(daemons, "healthy", 1, 2, 200, params=dict(
        checkpoint_every=40, checkpoint_seconds=20.0, rank0_pauses=True))
    sm, job = scraped[0], truth.job
    ckpt = {r: value(sm, "syncwatch_phase_seconds_total", phase="checkpoint", train_job=job, rank=r)
            for r in (0, 1)}
    sync = {r: value(sm, "syncwatch_phase_seconds_total", phase="sync", train_job=job, rank=r)
            for r in (0, 1)}
    assert ckpt == {0: pytest.approx(100.0), 1: 0.0}
    assert sync[1] - sync[0] == pytest.approx(100.0, abs=2.0)  # jitter aside
    assert [t.checkpoints for t in truth.reported] == [5, 0]
    cv = {r: value(sm, "syncwatch_step_cv", train_job=job, rank=r) for r in (0, 1)}
    assert cv[0] == pytest.approx(truth.cv(100), rel=1e-9) and cv[0] < 0.1
    assert cv[1] > 1
    # the exact exchange compares waits plus own pauses: both ranks idled through the save, so
    # it is no slack for rank 1 (100 s with the waits alone) and no skew. The exported slack is
    # what the ranks sent (the exchange's MIN/MAX derivation, window by window) and the model's
    # ground truth, summed step by step apart from it
    slack = {r: value(sm, "syncwatch_slack_seconds_total", train_job=job, rank=r) for r in (0, 1)}
    assert slack == {r: pytest.approx(truth.reported[r].slack_seconds, rel=1e-9) for r in (0, 1)}
    assert slack == {r: pytest.approx(truth.slack_seconds[r], rel=1e-9) for r in (0, 1)}
    assert {r: value(sm, "syncwatch_last_arrivals_total", train_job=job, rank=r)
            for r in (0, 1)} == {r: truth.last_arrivals[r] for r in (0, 1)}
    assert max(slack.values()) < 5.0
    assert value(sm, "syncwatch_barrier_skew_seconds_sum", train_job=job) < 5.0


def test_one_stall_among_slow_steps_leaves_the_cv_after_cv_seconds_of_steps(cluster):
    """~10 s steps and one 30 s stall in rank 0's data loading at step 60. Just after it the
    exported CV is well over the variance page's 0.15; 240 s of steps later (--cv-seconds) it
    is back at the jitter's, though the last W = 100 steps still hold the stall. On every rank
    (they all wait for rank 0), each time the truth's."""
    params = dict(compute_seconds=10.0 / 1.15, stall_at=(60,), stall_at_seconds=30.0 / (10.0 / 1.15))
    daemons = cluster(2)
    runs = {steps: run_through([d], "healthy", 1, 2, steps, params=params)
            for d, steps in zip(daemons, (63, 90))}
    for steps, (truth, scraped) in runs.items():
        for rank in (0, 1):
            cv = value(scraped[0], "syncwatch_step_cv", train_job=truth.job, rank=rank)
            assert cv == pytest.approx(truth.cv(), rel=1e-9)
            assert (cv > 0.3) if steps == 63 else (cv < 0.05)
    truth = runs[90][0]
    assert max(truth.window_step_seconds) > 35 and truth.cv(seconds=math.inf) > 0.15


def test_truths_window_is_the_daemons_after_a_restart(cluster):
    """After a restart the daemon's window holds only the new processes' steps after their first:
    31 steps into attempt 1 (steps 101..131), 30 of them, none of attempt 0's."""
    daemons = cluster(1)
    truth, scraped = run_through(daemons, "restarts", 1, 2, 161)
    assert truth.attempt == 1
    sm = scraped[0]
    assert value(sm, "syncwatch_step_cv", train_job=truth.job, rank=1) == pytest.approx(
        truth.cv(100), rel=1e-9)


def normalize(text: str) -> str:
    """Stable order of series within each family (their order follows record arrival order across
    ranks, which the senders' retry threads may interleave) and no version string."""
    text = re.sub(r'syncwatch_build_info\{version="[^"]*"\}', 'syncwatch_build_info{version="VERSION"}', text)
    out, block = [], []

    def series_key(line: str) -> str:
        labels = line.partition("{")[2].rpartition("}")[0]
        return re.sub(r',?le="[^"]*"', "", labels)

    def flush():
        out.extend(sorted(block, key=series_key))  # stable: buckets keep their order
        block.clear()

    for line in text.splitlines():
        if line.startswith("#"):
            flush()
            out.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out) + "\n"


def test_golden_exposition(cluster):
    """A fixed scenario (straggler, 2 nodes x 2 ranks, 60 steps, seed 0, virtual clock) scrapes to
    exactly the checked-in exposition. Any change to what the daemon exports, or to what the
    simulator sends, shows up here as a readable diff."""
    daemons = cluster(2)
    truth, _ = run_through(daemons, "straggler", 2, 2, 60, exchange_every=20, heartbeat_every=5.0)
    got = "".join(f"# ---- daemon of {node_name(PREFIX, n)}\n" + normalize(scrape_text(d.url))
                  for n, d in enumerate(daemons))
    if UPDATE_GOLDEN or not GOLDEN.exists():
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
        if not UPDATE_GOLDEN:
            pytest.fail(f"{GOLDEN} did not exist; written now, review and commit it")
    assert got == GOLDEN.read_text(), (
        f"exposition differs from {GOLDEN.name}; if intended, regenerate with SYNCWATCH_UPDATE_GOLDEN=1")
