"""The simulator's driver against plain receivers: what goes over the wire is what the truth says.

Each node's receiver is a real Unix datagram socket read by a thread and decoded with the real
``protocol.Decoder``, so these tests hold whatever daemon sits on the other end.
"""

import collections
import os
import re
import socket
import tempfile
import threading
import time

import pytest

from syncwatch.protocol import MAX_SECONDS, Decoder, EndRecord, HeartbeatRecord, StepRecord
from syncwatch.sim.driver import Driver
from syncwatch.sim.scenarios import ScenarioThread, run_scenario, scenario_params, straggler_rank

START = 1_700_000_000.0


class Receiver:
    """Reads and decodes every datagram sent to one Unix socket (one simulated node's daemon)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.records = []
        self.errors = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        decoder = Decoder()
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            try:
                self.records.append(decoder.decode(data))
            except Exception as e:  # a test failure, reported by the test
                self.errors.append(e)

    def wait_for(self, n: int, timeout: float = 10.0):
        end = time.monotonic() + timeout
        while len(self.records) < n and time.monotonic() < end:
            time.sleep(0.01)

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


@pytest.fixture
def receivers():
    made = []
    d = tempfile.mkdtemp(prefix="sw-sim-")

    def make(n):
        for i in range(n):
            made.append(Receiver(os.path.join(d, f"node{i}.sock")))
        return made

    yield make
    for r in made:
        r.close()


def by_kind(receivers, kind):
    return [rec for r in receivers for rec in r.records if isinstance(rec, kind)]


def test_fast_run_delivers_every_record_and_exact_totals(receivers):
    rx = receivers(3)
    truth = run_scenario("straggler", nodes=3, ranks_per_node=4, steps=120,
                         sockets=[r.path for r in rx], start_wall=START, exchange_every=50)
    for r in rx:
        r.wait_for(truth.records_sent // 3)
    assert truth.dropped == 0
    assert not any(r.errors for r in rx)
    steps = by_kind(rx, StepRecord)
    assert len(steps) == truth.step_records == 120 * 12
    assert len(by_kind(rx, HeartbeatRecord)) == truth.heartbeat_records > 0
    assert len(by_kind(rx, EndRecord)) == truth.end_records == 12
    # each node's receiver got exactly its own ranks
    for n, r in enumerate(rx):
        assert {rec.identity.node for rec in r.records} == {f"sim-node-{n:02d}"}
        assert {rec.identity.rank for rec in r.records} == set(range(4 * n, 4 * n + 4))
    last = {}
    for rec in steps:
        last[rec.identity.rank] = rec
    for rank, rec in last.items():
        assert rec.exact and rec.step == 120 and rec.identity.world_size == 12
        assert rec.totals == truth.reported[rank]
        assert rec.totals.steps == 120
        assert rec.totals.slack_seconds == pytest.approx(truth.slack_seconds[rank], rel=1e-9)
        assert rec.totals.last_arrivals == truth.last_arrivals[rank]
        assert rec.totals.step_seconds == pytest.approx(sum(s.step_seconds for s in truth.steps))
        assert rec.wall_time == pytest.approx(START + truth.virtual_seconds)
    s = straggler_rank(12)
    assert last[s].totals.last_arrivals >= 95
    # global rank 0 carries the skew histogram, nobody else does
    assert last[0].skew.count == 120
    assert last[0].skew.sum == pytest.approx(sum(st.skew for st in truth.steps))
    assert all(rec.skew is None for rec in steps if rec.identity.rank != 0)
    # per-step values on the wire are the model's
    st = truth.steps[41]
    wire = [rec for rec in steps if rec.step == st.step]
    assert sorted(rec.wait_seconds for rec in wire) == sorted(st.waits)
    assert {rec.step_seconds for rec in wire} == {st.step_seconds}


def test_the_longest_compute_accepted_gives_records_the_daemons_take(receivers):
    """compute_seconds=9e5 ran, and every step record and the heartbeats late in a step were
    rejected by the decoder (bad_value: step_seconds 1035704.59 is not within 0..1e+06) while
    the truth counted them; it is refused now, and the longest accepted one decodes whole."""
    with pytest.raises(ValueError, match="protocol.MAX_SECONDS"):
        run_scenario("healthy", nodes=1, ranks_per_node=2, params={"compute_seconds": 9e5})
    most = 0.999 * MAX_SECONDS / scenario_params("healthy", 1, 2).longest_step_seconds
    rx = receivers(1)
    truth = run_scenario("healthy", nodes=1, ranks_per_node=2, steps=3, sockets=[rx[0].path],
                         start_wall=START, heartbeat_every=1e5, params={"compute_seconds": most})
    rx[0].wait_for(truth.records_sent)
    assert rx[0].errors == []
    assert len(by_kind(rx, StepRecord)) == truth.step_records == 6
    assert len(by_kind(rx, HeartbeatRecord)) == truth.heartbeat_records > 0


def daemon_views(records):
    """What a daemon holds of each rank after each step record: the phase and time in it of its
    latest heartbeat, its highest step and collective sequence."""
    from syncwatch.daemon.config import DaemonConfig
    from syncwatch.daemon.state import State
    state = State(DaemonConfig(socket=None))
    views = []
    for rec in records:
        state.apply(rec)
        if isinstance(rec, StepRecord):
            r = state.jobs[rec.identity.train_job].ranks[rec.identity.rank]
            views.append((rec.identity.rank, rec.step, r.hb_phase, pytest.approx(r.hb_elapsed),
                          r.last_step, r.seq))
    return views


def test_fast_mode_bounds_the_heartbeats_of_a_long_step(receivers, monkeypatch):
    """A heartbeat every ``heartbeat_every`` virtual seconds of a long step: compute_seconds=5e5
    sent over a million records for 5 steps, for minutes, where the daemon keeps only what the
    step's last heartbeat says (phase, time in it, step, collective sequence; no time of it). Fast
    mode now sends at most MAX_FAST_HEARTBEATS_PER_STEP per rank and step, spread over it and the
    last one kept: the daemon holds the same after every step as with all of them."""
    from syncwatch.sim import driver
    params = {"compute_seconds": 300.0}
    rx = receivers(2)
    truth = run_scenario("healthy", nodes=1, ranks_per_node=2, steps=4, sockets=[rx[0].path],
                         start_wall=START, heartbeat_every=1.0, params=params)
    rx[0].wait_for(truth.records_sent)
    beats = by_kind(rx[:1], HeartbeatRecord)
    assert 0 < len(beats) == truth.heartbeat_records <= 4 * 2 * driver.MAX_FAST_HEARTBEATS_PER_STEP
    assert {h.phase for h in beats} >= {"data", "forward", "backward", "sync"}
    monkeypatch.setattr(driver, "MAX_FAST_HEARTBEATS_PER_STEP", 10**9)  # every heartbeat
    every = run_scenario("healthy", nodes=1, ranks_per_node=2, steps=4, sockets=[rx[1].path],
                         start_wall=START, heartbeat_every=1.0, params=params)
    rx[1].wait_for(every.records_sent, timeout=60)
    assert every.heartbeat_records > 4 * 2 * 300
    assert rx[0].errors == rx[1].errors == []
    assert daemon_views(rx[0].records) == daemon_views(rx[1].records)
    assert truth.reported == every.reported


@pytest.mark.parametrize("seconds,expected", [(0.0, [50, 100, 120]),
                                              (12.0, [50, 60, 70, 80, 90, 100, 110, 120])])
def test_slack_arrives_window_by_window(receivers, seconds, expected):
    """Between exchanges the slack counters stand still, as in the real exchange (K = 50). With a
    target of 12 s between exchanges, the windows after the first are the steps of 12 s (the
    healthy cluster's median step takes ~1.17 s: 10 steps)."""
    rx = receivers(1)
    truth = run_scenario("healthy", nodes=1, ranks_per_node=4, steps=120,
                         sockets=[rx[0].path], start_wall=START, exchange_every=50,
                         exchange_seconds=seconds)
    rx[0].wait_for(truth.records_sent)
    rank1 = [rec for rec in by_kind(rx, StepRecord) if rec.identity.rank == 1]
    seen = [rec.totals.slack_seconds for rec in rank1]
    changes = [r.step for r, prev in zip(rank1[1:], seen) if r.totals.slack_seconds != prev]
    assert changes == expected


def test_records_are_exact_only_once_the_attempts_first_window_is_exchanged(receivers):
    """As the real monitor: a record says exact (the daemon then exports slack and last arrivals,
    and the rules leave their fallback) and rank 0's carries the skew histogram only from the
    attempt's first exchange result on; a new process starts over."""
    rx = receivers(1)
    truth = run_scenario("restarts", nodes=1, ranks_per_node=2, steps=200,
                         sockets=[rx[0].path], start_wall=START, exchange_every=50)
    rx[0].wait_for(truth.records_sent)
    for rank in (0, 1):
        steps = [rec for rec in by_kind(rx, StepRecord) if rec.identity.rank == rank]
        for attempt, n in ((0, 130), (1, 70)):
            mine = [rec for rec in steps if rec.identity.attempt == attempt]
            assert len(mine) == n
            assert [rec.exact for rec in mine] == [False] * 49 + [True] * (n - 49)
            assert [rec.skew is not None for rec in mine] == (
                [False] * 49 + [True] * (n - 49) if rank == 0 else [False] * n)


def test_heartbeats_count_the_collective_a_rank_waits_in(receivers):
    """The collective sequence of the last collective entered, as the monitor counts it: in its
    step's compute a rank has entered the previous step's collective, in ``sync`` this one's."""
    rx = receivers(1)
    truth = run_scenario("healthy", nodes=1, ranks_per_node=2, steps=20, sockets=[rx[0].path],
                         start_wall=START, heartbeat_every=0.05)
    rx[0].wait_for(truth.records_sent)
    beats = by_kind(rx, HeartbeatRecord)
    assert {h.phase for h in beats} >= {"forward", "sync"}
    for h in beats:
        assert h.collective_sequence == h.last_step + (h.phase == "sync"), h


def test_restarts_change_attempt_pid_and_step_numbers(receivers):
    rx = receivers(2)
    truth = run_scenario("restarts", nodes=2, ranks_per_node=2, steps=400,
                         sockets=[r.path for r in rx], start_wall=START)
    for r in rx:
        r.wait_for(truth.records_sent // 2)
    assert truth.dropped == 0 and truth.rerun_steps == 40
    steps = [rec for rec in by_kind(rx, StepRecord) if rec.identity.rank == 3]
    attempts = collections.Counter(rec.identity.attempt for rec in steps)
    assert attempts == {0: 130, 1: 160, 2: 110}
    assert len({rec.identity.pid for rec in steps}) == 3
    numbers = [rec.step for rec in steps]
    assert numbers[129:131] == [130, 101]
    # a new process starts its counters from zero
    first_of_1 = next(rec for rec in steps if rec.identity.attempt == 1)
    assert first_of_1.totals.steps == 1
    assert steps[-1].totals == truth.reported[3]
    assert steps[-1].totals.checkpoints == 2  # steps 300 and 350 in attempt 2 (251..360)
    # no end record from the crashed attempts, one per rank from the last
    assert [e.identity.attempt for e in by_kind(rx, EndRecord)] == [2] * 4


def test_realtime_mode_takes_the_simulated_time_and_stops_on_request(receivers):
    rx = receivers(1)
    params = dict(compute_seconds=0.02)
    thread = ScenarioThread("healthy", [{"socket": rx[0].path}], nodes=1, ranks_per_node=2,
                            params=params, heartbeat_every=0.05, keep_steps=True)
    t0 = time.monotonic()
    thread.start()
    time.sleep(0.5)
    thread.stop()
    elapsed = time.monotonic() - t0
    assert not thread.is_alive() and thread.error is None
    truth = thread.truth
    # ~21 ms per step on the simulated clock: about 20 steps in 0.5 s (a loaded machine runs fewer)
    assert 5 <= truth.executed_steps <= 0.6 / 0.0205
    assert truth.virtual_seconds <= elapsed + 0.05
    rx[0].wait_for(truth.records_sent)
    hb = by_kind(rx, HeartbeatRecord)
    assert len(hb) >= 4
    assert {h.phase for h in hb} <= {"data", "forward", "backward", "optimizer", "sync"}
    walls = [rec.wall_time for rec in by_kind(rx, StepRecord)]
    assert abs(walls[-1] - time.time()) < 5  # real wall clock in real-time mode
    assert by_kind(rx, EndRecord) == []  # stopped, not completed


def test_a_driver_run_again_keeps_the_models_truth():
    """Model-only drivers are stepped by repeated ``run`` calls (the hardware tests): the truth of
    the later calls' steps counts as the first's, though the first call's processes are gone."""
    p = scenario_params("straggler", 2, 2)
    stepped, whole = Driver(p, 1), Driver(p, 1)
    stepped.run(30)
    stepped.run(30)
    whole.run(60)
    assert stepped.truth.last_arrivals == whole.truth.last_arrivals
    assert stepped.truth.slack_seconds == whole.truth.slack_seconds
    assert sum(whole.truth.last_arrivals) >= 60


def test_checkpoints_count_even_when_they_take_no_time():
    """The model resumes restarts from every checkpoint_every-th step whatever checkpoint_seconds
    is (default 0): each is a checkpoint the ranks report, as the monitor counts a checkpoint
    phase of any length."""
    p = scenario_params("healthy", 1, 2, checkpoint_every=10, fail_after=(25,))
    truth = Driver(p, 0).run(40)
    assert truth.restarts[0].resume_step == 21
    # attempt 1 ran steps 21..35: one checkpoint (step 30), none of attempt 0's
    assert [t.checkpoints for t in truth.reported] == [1, 1]


def test_driver_refuses_mismatched_targets():
    with pytest.raises(ValueError, match="targets"):
        Driver(scenario_params("healthy", 2, 2), targets=[{"socket": "/nonexistent"}])


def test_driver_refuses_more_ranks_per_node_than_the_protocol_identifies():
    """A simulated rank's GPU index is its local rank, and the protocol takes indices below 1024:
    1025 ranks per node died in the encoder with ProtocolError (bad_identity), a model-only run
    too; 1024 run."""
    with pytest.raises(ValueError, match="at most 1024 ranks per node"):
        Driver(scenario_params("healthy", 1, 1025))
    with pytest.raises(ValueError, match="at most 1024 ranks per node"):
        run_scenario("straggler", 2, 1025, 1)
    assert run_scenario("straggler", 1, 1024, 2).executed_steps == 2


@pytest.mark.parametrize("option, bad", [("time_scale", float("nan")), ("time_scale", float("inf")),
                                         ("time_scale", 0.0), ("heartbeat_every", float("nan")),
                                         ("heartbeat_every", -1.0), ("exchange_every", 2.5),
                                         ("exchange_every", -1), ("exchange_every", True)])
def test_driver_refuses_broken_clock_and_exchange_options(option, bad):
    """Each was accepted: time_scale=nan ran the real-time mode without sleeping (every sleep
    deadline NaN), time_scale=inf died at its first step (OverflowError in the wait),
    heartbeat_every=nan sent no heartbeat at all, exchange_every=2.5 never filled a window (no
    exact slack until the run's last step, none in a run stopped by its owner), and True was
    taken as 1."""
    with pytest.raises(ValueError, match=f"^{option} must be"):
        Driver(scenario_params("healthy", 1, 2), fast=False, **{option: bad})


@pytest.mark.parametrize("steps", [2.5, "3", True])
def test_a_run_refuses_a_step_count_that_is_no_whole_number(steps):
    """run(2.5) ran 3 steps, run(True) one; run_scenario(steps=2.5) too."""
    with pytest.raises(ValueError, match=f"^steps must be a whole number, not {re.escape(repr(steps))}$"):
        Driver(scenario_params("healthy", 1, 2)).run(steps)
    with pytest.raises(ValueError, match="^steps must be a whole number"):
        run_scenario("healthy", 1, 2, steps)


def test_realtime_pacing_starts_when_the_run_does():
    """Real-time pacing ran from the driver's construction: a driver built, then left a second
    before run() (or between two runs) sent its steps without sleeping until the virtual clock
    caught up with the time lost (0.92 s of virtual time in 0.002 s). Each run paces from its
    start, on the virtual time the model has reached."""
    p = scenario_params("healthy", 1, 2, compute_seconds=0.02)
    driver = Driver(p, 0, fast=False)
    for _ in range(2):  # a pause, the first run; another pause, a second run
        time.sleep(0.4)
        t0 = time.monotonic()
        virtual0 = driver.model.time
        driver.run(15)
        elapsed = time.monotonic() - t0
        ran = driver.model.time - virtual0
        assert ran > 0.25  # 15 steps of ~21 ms
        assert elapsed >= ran - 0.02, (elapsed, ran)


def test_a_scenario_thread_paces_from_its_start():
    """``ScenarioThread`` builds its driver at construction: the time until ``start()`` is not
    virtual time to catch up."""
    thread = ScenarioThread("healthy", None, nodes=1, ranks_per_node=2, steps=15,
                            params=dict(compute_seconds=0.02))
    time.sleep(0.4)
    t0 = time.monotonic()
    thread.start()
    thread.join(10)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive() and thread.error is None
    assert thread.truth.executed_steps == 15
    assert elapsed >= thread.truth.virtual_seconds - 0.02, (elapsed, thread.truth.virtual_seconds)
