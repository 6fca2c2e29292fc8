"""Unit tests of the rank-side instrumentation (single process; real sockets, real decoder)."""

import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import time

import pytest

from conftest import subprocess_env
from syncwatch.instrument import identity as ident_mod
from syncwatch.instrument import run as run_mod
from syncwatch.instrument.clock import FAKE_CALLS, CudaEventClock, HostClock, TorchCalls
from syncwatch.instrument.monitor import Monitor
from syncwatch.protocol import (MAX_ATTEMPT, PHASE_INDEX, Decoder, EndRecord, HeartbeatRecord,
                                Identity, StepRecord)
from syncwatch.sender import Sender
from syncwatch.skew import WindowResult
from instrument.receiver import Receiver

# Tests that run torch in a child process: skipped where torch is not installed (the test extra
# installs it), as the ones that import it are
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs torch (pip install -e '.[test]')")

IDENT = Identity(train_job="unit", attempt=0, rank=0, local_rank=0, world_size=4, node="n1",
                 pid=os.getpid())


def wait_for(cond, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def rx(sock_path):
    r = Receiver(sock_path)
    yield r
    r.close()


@pytest.fixture
def monitor_args(monkeypatch):
    """The keyword arguments ``init()`` makes its Monitor with (it still makes it): what it took
    for each setting, where a rank of world size 1 shows it nowhere else (no exchange is made)."""
    import syncwatch.instrument as sw
    given = []
    real = sw.Monitor

    def spy(*args, **kwargs):
        given.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(sw, "Monitor", spy)
    return given


DEFAULT_SETTINGS = {"exchange_every": 50, "exchange_seconds": 30.0, "heartbeat_seconds": 5.0}


def make_monitor(rx, **kw):
    kw.setdefault("heartbeat_seconds", 0)
    return Monitor(kw.pop("identity", IDENT), Sender(rx.path), **kw)


def steps(rx, n):
    assert wait_for(lambda: len(rx.of(StepRecord)) >= n), rx.records
    return rx.of(StepRecord)


def phase(rec, name):
    return rec.phase_seconds[PHASE_INDEX[name]]


class Span:
    """The wall time of a with-block: the most that syncwatch can have measured inside it. A
    sleep on a loaded machine overshoots by tens of ms, so an upper bound is measured, not fixed
    (a fixed 5 ms margin failed in CI)."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


# --------------------------------------------------------------------------- phases and steps

def test_phases_steps_and_samples_reach_the_daemon(rx):
    m = make_monitor(rx)
    for _ in range(2):
        with Span() as data, m.phase("data"):
            time.sleep(0.01)
        with Span() as forward, m.phase("forward"):
            time.sleep(0.02)
        with m.phase("my-custom-phase"):
            time.sleep(0.005)
        with m.phase("checkpoint"):
            pass
        m.step(samples=32, tokens=4096)
    recs = steps(rx, 2)
    r = recs[-1]
    assert [x.step for x in recs] == [1, 2]
    assert 0.02 <= phase(r, "forward") <= forward.seconds
    assert 0.01 <= phase(r, "data") <= data.seconds
    assert 0.005 <= phase(r, "other") <= r.step_seconds - phase(r, "forward") - phase(r, "data")
    assert r.step_seconds >= sum(r.phase_seconds)
    assert r.totals.steps == 2 and r.totals.samples == 64 and r.totals.tokens == 8192
    assert r.has_tokens and r.totals.checkpoints == 2
    assert r.totals.step_seconds == pytest.approx(sum(x.step_seconds for x in recs))
    assert not r.exact and r.skew is None
    m.shutdown()
    assert wait_for(lambda: rx.of(EndRecord))
    assert rx.of(EndRecord)[0].last_step == 2 and rx.of(EndRecord)[0].reason == "completed"


def test_the_first_step_starts_at_its_first_phase_not_at_init(rx):
    """Between init() and the loop come the model's setup, a checkpoint load, a barrier: no
    step's. The first step starts at its first phase (without phases: at init()); the barrier
    before it still counts in the collective sequence."""
    m = make_monitor(rx)
    time.sleep(0.2)  # a checkpoint load
    m.timed_collective(time.sleep, (0.05,), {}, async_index=1)  # a barrier before the loop
    for _ in range(2):
        with m.phase("data"):
            time.sleep(0.01)
        with m.phase("forward"):
            time.sleep(0.01)
        m.step(1)
    first, second = steps(rx, 2)
    assert 0.02 <= first.step_seconds < 0.1, first
    assert phase(first, "sync") == 0 and first.wait_seconds == 0
    assert first.collective_sequence == 1
    assert second.totals.step_seconds == pytest.approx(first.step_seconds + second.step_seconds)
    m.shutdown()

    rx.records.clear()
    m = make_monitor(rx)  # no phases: the first step runs from init()
    time.sleep(0.2)
    m.step(1)
    assert steps(rx, 1)[0].step_seconds >= 0.2
    m.shutdown()


def test_collective_wait_moves_from_the_enclosing_phase_to_sync(rx):
    m = make_monitor(rx)
    with m.phase("backward"):
        with Span() as compute:
            time.sleep(0.02)
        with Span() as wait:
            m.timed_collective(time.sleep, (0.05,), {}, async_index=1)
    m.step(1)
    r = steps(rx, 1)[0]
    assert 0.05 <= phase(r, "sync") <= wait.seconds
    assert 0.02 <= phase(r, "backward") < compute.seconds + 0.01  # the wait is not backward's
    assert r.wait_seconds == phase(r, "sync")
    assert r.collective_sequence == 1
    m.shutdown()


def test_async_collective_is_counted_not_timed(rx):
    m = make_monitor(rx)
    m.timed_collective(lambda *a, **k: time.sleep(0.03), (1, 2, 3, True), {}, async_index=3)
    m.timed_collective(lambda *a, **k: None, (), {"async_op": True}, async_index=3)
    m.step(1)
    r = steps(rx, 1)[0]
    assert r.collective_sequence == 2 and phase(r, "sync") == 0.0
    m.shutdown()


def test_ddp_gradient_wait_is_last_bucket_ready_to_done(rx):
    m = make_monitor(rx)
    with m.phase("forward"):      # another blocking collective: sync time, not the gradient wait
        m.timed_collective(time.sleep, (0.05,), {}, async_index=1)
    with m.phase("backward"):
        with Span() as compute:
            m.bucket_ready()      # bucket 0 ready: its collective overlaps compute
            time.sleep(0.02)
            m.bucket_done()
        with Span() as wait:
            m.bucket_ready()      # last bucket: backward compute ends here
            time.sleep(0.03)      # waiting for the slowest rank
            m.bucket_done()
    m.step(1)
    r = steps(rx, 1)[0]
    assert 0.03 <= r.wait_seconds <= wait.seconds
    assert 0.02 <= phase(r, "backward") < compute.seconds + 0.01
    assert phase(r, "sync") >= r.wait_seconds + 0.05
    assert r.collective_sequence == 3
    m.shutdown()


def test_errors_inside_the_training_code_pass_through_untouched(rx):
    m = make_monitor(rx)
    with pytest.raises(KeyError):
        with m.phase("forward"):
            raise KeyError("user bug")

    def failing_collective():
        raise RuntimeError("peer gone")
    with pytest.raises(RuntimeError, match="peer gone"):
        m.timed_collective(failing_collective, (), {}, async_index=3)
    m.step(1)
    r = steps(rx, 1)[0]
    assert r.totals.internal_errors == 0 and r.collective_sequence == 1
    m.shutdown()


class BrokenClock(HostClock):
    def __init__(self):
        self.calls = 0
        self.broken = True

    def mark(self):
        self.calls += 1
        if self.broken and self.calls > 1:  # the constructor's first mark works
            raise OSError("clock broke")
        return time.perf_counter_ns()


def test_internal_errors_are_counted_and_never_raised(rx, caplog):
    clock = BrokenClock()
    m = make_monitor(rx, clock=clock)
    for _ in range(3):
        with m.phase("forward"):
            pass
        m.step(1)                    # all fail inside: nothing may escape
    clock.broken = False
    m.step(1)
    r = steps(rx, 1)[-1]
    assert r.totals.internal_errors == 9  # 3 x (phase enter, phase exit, step)
    assert sum("internal error" in rec.message for rec in caplog.records) == 1  # logged once
    m.shutdown()


@needs_torch
def test_bad_step_arguments_are_refused_without_losing_a_step_or_later_records(rx, caplog):
    """``step()`` with a count that is no number, not finite, negative or absurd, or a step
    number that is no integer in range: the step still counts (with 0 of it, or numbered
    previous + 1), each is an internal error, each argument is logged once, and no record the
    daemon's decoder would refuse is sent (one infinite count in the cumulative totals used to
    make it refuse every later record of the rank)."""
    import torch
    m = make_monitor(rx)
    m.step(samples=32, tokens=100, step=10)
    bad = ["abc", float("inf"), float("nan"), -3, 1e300, torch.ones(2)]
    for x in bad:
        m.step(samples=x, tokens=x)
    for x in ["11", 7.5, -5, float("nan"), 2 ** 60]:
        m.step(samples=1, step=x)
    m.step(samples=torch.tensor(8), tokens=2.5, step=torch.tensor(30))  # taken as they are
    m.step(samples=16, tokens=10, step=31.0)
    recs = steps(rx, 14)
    assert rx.rejected == []
    assert [r.step for r in recs] == [10, *range(11, 17), *range(17, 22), 30, 31]
    assert {r.identity.attempt for r in recs} == {0}
    assert [r.samples for r in recs] == [32] + [0] * 6 + [1] * 5 + [8, 16]
    assert [r.tokens for r in recs] == [100] + [0] * 11 + [2.5, 10]
    last = recs[-1].totals
    assert (last.steps, last.samples, last.tokens) == (14, 61, 112.5)
    assert last.internal_errors == 2 * len(bad) + 5
    warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 3 and all(w.startswith("syncwatch: step(") for w in warned), warned
    assert "step(samples='abc') refused, counted as 0: expected a number from 0 to" in warned[0]
    m.shutdown()


@needs_torch
def test_strings_and_bools_are_no_numbers_to_step(rx, caplog):
    """``float()`` parses "3" and takes True for 1, and ``int()`` likewise: ``samples="3"``
    counted 3 samples, ``samples=True`` one, and ``step=True`` numbered the step 1 (a number
    going back: a new attempt, a counted restart). The docs take numbers and one-element
    tensors: these are refused like the other bad arguments (counted, logged once per
    argument), and numpy scalars and tensors still count."""
    import numpy as np
    import torch
    m = make_monitor(rx)
    m.step(samples=2, step=5)
    m.step(samples=True, tokens="3")
    m.step(samples="3", tokens=b"5", step="7")
    m.step(samples=1, step=True)
    m.step(samples=np.int64(4), tokens=np.float32(1.5), step=np.int64(9))
    m.step(samples=torch.tensor(6), step=torch.tensor(10))
    recs = steps(rx, 6)
    assert rx.rejected == []
    assert [(r.step, r.identity.attempt) for r in recs] == [
        (5, 0), (6, 0), (7, 0), (8, 0), (9, 0), (10, 0)]
    assert [r.samples for r in recs] == [2, 0, 0, 1, 4, 6]
    assert [r.tokens for r in recs] == [0, 0, 0, 0, 1.5, 0]
    assert recs[-1].totals.internal_errors == 6
    warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert [w.split(")")[0] for w in warned] == [
        "syncwatch: step(samples=True", "syncwatch: step(tokens='3'",
        "syncwatch: step(step='7'"], warned
    m.shutdown()


def test_step_number_going_backwards_starts_a_new_attempt(rx):
    m = make_monitor(rx)
    for s in (1, 2, 3, 2, 3):
        m.step(1, step=s)
    recs = steps(rx, 5)
    assert [(r.step, r.identity.attempt) for r in recs] == [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1)]
    m.shutdown()


def test_a_job_counting_its_steps_from_0_stays_in_its_first_attempt(rx):
    """Step 0 is the first step, not one that went back: its identity is that of the heartbeats
    sent before it (a new attempt there would count a restart at the daemon)."""
    m = make_monitor(rx, heartbeat_seconds=0.05)
    assert wait_for(lambda: rx.of(HeartbeatRecord))
    for s in (0, 1, 2):
        m.step(1, step=s)
    recs = steps(rx, 3)
    assert [(r.step, r.identity.attempt) for r in recs] == [(0, 0), (1, 0), (2, 0)]
    assert {h.identity.attempt for h in rx.of(HeartbeatRecord)} == {0}
    m.shutdown()


def test_a_step_counter_that_keeps_going_back_starts_a_bounded_number_of_attempts(rx, caplog):
    """``step=`` given a per-epoch batch index (0, 1, 2, 0, 1, 2, ...) would start an attempt,
    a counted restart, every epoch: after ``MAX_NEW_ATTEMPTS`` the numbers that go back are
    refused (counted, logged once) and the steps go on numbered previous + 1."""
    from syncwatch.instrument.monitor import MAX_NEW_ATTEMPTS
    m = make_monitor(rx)
    epochs = MAX_NEW_ATTEMPTS + 4
    for _ in range(epochs):
        for i in range(3):
            m.step(1, step=i)
    recs = steps(rx, 3 * epochs)
    assert rx.rejected == []
    attempts = [(r.step, r.identity.attempt) for r in recs]
    assert attempts[:3 * (MAX_NEW_ATTEMPTS + 1)] == [
        (i, a) for a in range(MAX_NEW_ATTEMPTS + 1) for i in range(3)]
    after = attempts[3 * (MAX_NEW_ATTEMPTS + 1):]  # the rest of the job: one attempt, counting on
    assert after == [(3 + k, MAX_NEW_ATTEMPTS) for k in range(len(after))]
    assert recs[-1].totals.steps == 3 * epochs  # none lost
    assert recs[-1].totals.internal_errors == len(after)  # none of the later numbers is ahead
    warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 1 and "step(step=0) refused" in warned[0], warned
    m.shutdown()


def test_a_step_number_going_back_at_the_protocols_last_attempt_stays_in_it(rx):
    """An attempt from the launchers' restart counts can be the protocol's last one
    (MAX_ATTEMPT - 1): a step number going back then keeps it, rather than failing to encode."""
    last = MAX_ATTEMPT - 1
    m = make_monitor(rx, identity=Identity(train_job="unit", attempt=last, rank=0, local_rank=0,
                                           world_size=4, node="n1", pid=os.getpid()))
    for s in (1, 2, 1):
        m.step(1, step=s)
    recs = steps(rx, 3)
    assert [(r.step, r.identity.attempt) for r in recs] == [(1, last), (2, last), (1, last)]
    assert m.errors == 0 and rx.rejected == []
    m.shutdown()


class FakeExchange:
    def __init__(self):
        import collections
        self.results = collections.deque()
        self.windows = []
        self.step_seconds = []
        self.failed = False

    def submit(self, waits, step_seconds=0.0):
        self.windows.append(list(waits))
        self.step_seconds.append(step_seconds)

    def drain(self, timeout):
        return True

    def stop(self, timeout=0):
        pass


def test_a_save_after_the_last_step_is_not_counted_without_its_time(rx):
    """A final save after the last step: no step holds its time, and the last step's record
    that shutdown sends again (with the exchange's last results) counted it all the same, which
    lowered ``checkpoint_seconds / checkpoints``, a save's cost for the analysis."""
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=2)
    for _ in range(2):
        with m.phase("checkpoint"):
            time.sleep(0.01)
        m.step(1)
    with m.phase("checkpoint"):
        time.sleep(0.01)
    m.flush()
    ex.results.append(WindowResult(0.0, 2, (0.01, 0.01)))  # the last window's: sent again
    m.shutdown()
    recs = steps(rx, 3)
    assert [r.step for r in recs] == [1, 2, 2] and recs[-1].exact
    assert [r.totals.checkpoints for r in recs] == [1, 2, 2]


def test_exchange_windows_and_results_feed_slack_and_rank0_skew(rx):
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=3)
    for _ in range(3):
        m.step(1)
    m.flush()  # what the records thread does every flush_seconds
    assert len(ex.windows) == 1 and len(ex.windows[0]) == 3
    ex.results.append(WindowResult(0.09, 2, (0.03, 0.0004, 0.2)))
    m.step(1)
    r = steps(rx, 4)[-1]
    assert r.exact and r.totals.slack_seconds == pytest.approx(0.09) and r.totals.last_arrivals == 2
    assert r.skew.count == 3 and r.skew.sum == pytest.approx(0.2304)
    assert r.skew.buckets[2] == 1 and r.skew.buckets[-1] == 3
    m.shutdown()

    rx.records.clear()
    ex2 = FakeExchange()
    m2 = make_monitor(rx, exchange=ex2, exchange_every=1,
                      identity=Identity("unit", 0, 3, 3, 4, "n1", os.getpid()))
    ex2.results.append(WindowResult(0.0, 1, (0.5,)))
    m2.step(1)
    r = steps(rx, 1)[0]
    assert r.exact and r.skew is None and r.totals.last_arrivals == 1  # only rank 0 sends skew
    m2.shutdown()


def test_the_exchange_compares_a_steps_waits_and_its_own_pauses(rx):
    """The exchanged value of a step is its time off its own compute: every collective wait
    (the gradient wait and a barrier after it) plus its checkpoint and eval phases. Rank 0 saving
    30 ms and its peer waiting for it in a barrier both idle 30 ms: no skew from the save."""
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=3)
    with m.phase("forward"):
        time.sleep(0.005)
    m.step(1)                                  # no wait, no pause: 0
    with Span() as pauses:
        with m.phase("checkpoint"):
            time.sleep(0.03)
        with m.phase("eval"):
            time.sleep(0.02)
    m.step(1)                                  # the pauses: 50 ms
    with Span() as waits:
        with Span() as gradient_wait:
            m.bucket_ready()
            time.sleep(0.01)
            m.grads_synced()
        m.timed_collective(lambda: time.sleep(0.02), (), {}, 0)
    m.step(1)                                  # gradient wait 10 ms + a barrier's 20 ms
    m.flush()
    (window,) = ex.windows
    assert window[0] < 0.002
    assert 0.05 <= window[1] <= pauses.seconds, window
    assert 0.03 <= window[2] <= waits.seconds, window
    r = steps(rx, 3)[2]
    assert 0.01 <= r.wait_seconds <= gradient_wait.seconds  # the record's wait: the gradient's
    m.shutdown()


def test_window_size_after_the_first_takes_the_target_seconds_at_most_k():
    from syncwatch.skew import window_size
    assert window_size(10.0, 50, 30.0) == 3
    assert window_size(0.5, 50, 30.0) == 50
    assert window_size(120.0, 50, 30.0) == 1
    assert window_size(0.0, 50, 30.0) == 50  # no step time measured: K
    assert window_size(10.0, 50, 0.0) == 50  # adaptation off


def first_window_then(m, ex, k, step_seconds, more):
    """K steps, the first window's result (the slowest rank's median ``step_seconds``) back,
    then ``more`` steps, each batch replayed as the records thread does."""
    for _ in range(k):
        m.step(1)
    m.flush()
    ex.results.append(WindowResult(0.0, 0, (0.0,) * k, step_seconds=step_seconds))
    for _ in range(more):
        m.step(1)
    m.flush()


@pytest.mark.parametrize("seconds", [float("inf"), float("nan")])
def test_skew_seconds_of_inf_or_nan_keeps_windows_of_k(rx, seconds):
    """``SYNCWATCH_SKEW_SECONDS=inf`` (never shorter than K) is read as given: sizing the windows
    with it raised on the records thread, which lost that step's record and, the first result
    taken, never cut a window again (the waits piling up for good)."""
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=3, exchange_seconds=seconds)
    first_window_then(m, ex, 3, 0.1, 6)
    assert [len(w) for w in ex.windows] == [3, 3, 3] and m.errors == 0
    assert [r.step for r in steps(rx, 9)] == list(range(1, 10))
    m.shutdown()


def test_windows_after_the_first_are_sized_by_its_result(rx):
    """The first window is K steps. The next ones wait for its result, whose all-reduced median
    step time sizes them (the same on every rank), then go as soon as they are full."""
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=10, exchange_seconds=0.2)
    for i in range(16):
        time.sleep(0.5 if i == 3 else 0.01)  # one slow step (a checkpoint) moves no median
        m.step(1)
    m.flush()
    assert [len(w) for w in ex.windows] == [10]  # the next size is not known yet
    assert 0.01 <= ex.step_seconds[0] < 0.05  # the mean would be over 0.059
    ex.results.append(WindowResult(0.0, 0, (0.0,) * 10, step_seconds=0.05))  # slowest rank's
    for _ in range(6):
        m.step(1)
    m.flush()
    assert [len(w) for w in ex.windows] == [10, 4, 4, 4]  # 0.2 s at 0.05 s a step
    m.shutdown()

    ex2 = FakeExchange()  # fast steps: K stays
    m2 = make_monitor(rx, exchange=ex2, exchange_every=3)
    first_window_then(m2, ex2, 3, 0.001, 6)
    assert [len(w) for w in ex2.windows] == [3, 3, 3]
    ex2.failed = True  # the exchange stopped: no window waits for a result that never comes
    for _ in range(5):
        m2.step(1)
    m2.flush()
    assert m2.exchange_every == 0 and m2._window == [] and len(ex2.windows) == 3
    m2.shutdown()


def test_shutdown_sends_the_last_windows_exchange_results_with_the_last_step_again(rx):
    """The last full window's exchange finishes after the last step record went out: shutdown
    sends that record again, with the results in its totals (a partial window is not
    exchanged: its ranks may have run different numbers of steps)."""
    ex = FakeExchange()
    m = make_monitor(rx, exchange=ex, exchange_every=3)
    for _ in range(3):
        m.step(1)
    m.flush()
    ex.results.append(WindowResult(0.12, 3, (0.04, 0.05, 0.06)))  # finished meanwhile
    m.shutdown()
    recs = steps(rx, 4)
    assert [r.step for r in recs] == [1, 2, 3, 3]
    first, again = recs[2], recs[3]
    assert not first.exact and first.totals.last_arrivals == 0 and first.skew is None
    assert again.exact and again.totals.last_arrivals == 3
    assert again.totals.slack_seconds == pytest.approx(0.12)
    assert again.skew.count == 3 and again.skew.sum == pytest.approx(0.15)
    assert (again.totals.steps, again.step_seconds, again.samples) == (
        first.totals.steps, first.step_seconds, first.samples)

    assert wait_for(lambda: rx.of(EndRecord))  # the first monitor's last record, read before
    rx.records.clear()                          # the clear, not taken for the second's
    ex2 = FakeExchange()  # nothing left to report: no second copy
    m2 = make_monitor(rx, exchange=ex2, exchange_every=3)
    m2.step(1)
    m2.shutdown()
    assert wait_for(lambda: rx.of(EndRecord)), rx.records  # sent after any copy
    assert [r.step for r in rx.of(StepRecord)] == [1]


def test_shutdown_exchanges_the_windows_held_for_the_first_result(rx):
    """A job ending before its first window's result is back: the windows held behind it are
    sized by that result at shutdown and exchanged too (a partial window is not)."""
    class Exchange(FakeExchange):
        def drain(self, timeout):  # the peers' windows arrive: each submitted one finishes
            for w in self.windows[len(self.done):]:
                self.done.append(w)
                self.results.append(WindowResult(0.01 * len(w), len(w), (0.0,) * len(w)))
            return True
    ex = Exchange()
    ex.done = []
    m = make_monitor(rx, exchange=ex, exchange_every=3)
    for _ in range(7):
        m.step(1)
    m.flush()
    assert [len(w) for w in ex.windows] == [3]
    m.shutdown()
    assert [len(w) for w in ex.windows] == [3, 3]
    last = steps(rx, 8)[-1]
    assert last.step == 7 and last.totals.last_arrivals == 6
    assert last.totals.slack_seconds == pytest.approx(0.06)


def test_a_blocking_collective_on_another_thread_is_counted_not_timed(rx):
    """A collective another thread blocks in (DCP's ``async_save`` uploading in its executor,
    ending in a ``dist.barrier`` while the loop trains on; a metrics thread) is none of the
    training thread's wait. Timed, it was taken out of the training thread's phases and counted
    whole as ``sync`` of the step it ended in: 0.15 s of ``sync`` in a 0.03 s step, its phases
    summing to 5 times the step."""
    import threading
    m = make_monitor(rx)
    t = threading.Thread(target=m.timed_collective, args=(time.sleep, (0.15,), {}, 1))
    with m.phase("forward"):
        pass
    m.step(1)
    t.start()
    for _ in range(6):
        with m.phase("data"):
            time.sleep(0.03)
        m.step(1)
    t.join()
    recs = steps(rx, 7)
    for r in recs:
        assert sum(r.phase_seconds) <= r.step_seconds + 1e-6, r
        assert phase(r, "sync") == 0 and r.wait_seconds == 0, r
    assert all(phase(r, "data") >= 0.03 for r in recs[1:]), recs
    assert recs[-1].collective_sequence == 1  # counted all the same
    assert not m.in_sync()
    m.shutdown()


@needs_torch
def test_a_collective_in_a_backward_on_another_thread_is_timed(rx):
    """Autograd runs a CUDA backward on a thread of its own, and FSDP's reduce-scatters with it:
    those waits are the training step's, whatever thread calls them. Here a backward runs on a
    thread of the test's (CPU autograd runs it on the caller's) and its collective is timed."""
    import threading

    import torch

    from syncwatch.instrument import hooks
    m = make_monitor(rx, in_backward=hooks.backward_probe())

    class Reduced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            m.timed_collective(time.sleep, (0.05,), {}, 1)  # a reduce-scatter of 50 ms
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    with Span() as backward, m.phase("backward"):
        t = threading.Thread(target=lambda: Reduced.apply(x).sum().backward())
        t.start()
        t.join()
    m.step(1)
    r = steps(rx, 1)[0]
    assert 0.05 <= phase(r, "sync") <= backward.seconds and r.collective_sequence == 1
    assert phase(r, "backward") + phase(r, "sync") <= backward.seconds
    m.shutdown()


def test_heartbeat_shows_a_rank_inside_a_collective(rx):
    m = make_monitor(rx, heartbeat_seconds=0.05)
    m.step(1)
    with m.phase("backward"):
        m.timed_collective(time.sleep, (0.4,), {}, async_index=1)
    m.shutdown()
    hbs = rx.of(HeartbeatRecord)
    in_sync = [h for h in hbs if h.phase == "sync"]
    assert len(in_sync) >= 3
    assert max(h.phase_elapsed for h in in_sync) >= 0.2
    assert all(h.last_step == 1 and h.collective_sequence == 1 for h in in_sync)
    assert in_sync[0].last_step_wall_time > 1e9


def test_a_gradient_sync_that_raised_is_not_reported_as_sync_after_the_step(rx):
    """A backward that raised inside DDP's finalize (gradients ready noted, never synchronized)
    and that the script caught and went on from (an OOM skip): once a step ends the rank is no
    longer in sync; its heartbeats had read "sync" for the rest of the run."""
    m = make_monitor(rx)
    m.bucket_ready()   # gradients ready; DDP's finalize raised: no "synchronized"
    m.step(1)
    m.flush()
    assert not m.in_sync()
    m.bucket_ready()   # the next backward synchronizes
    m.bucket_done()
    m.step(1)
    m.flush()
    assert not m.in_sync() and steps(rx, 2)[1].wait_seconds >= 0
    m.shutdown()


def test_a_phase_inside_another_counts_in_the_inner_one_only(rx):
    """Phases are exclusive, as ``sync`` is: a save or an evaluation inside ``forward`` is the
    inner phase's time, and ``forward`` goes on after it. It counted in both (a 30 ms save in a
    60 ms forward read forward 60 ms, checkpoint 30 ms: phases summing past the step). A phase
    the script leaves open ends with the one around it, its time its own."""
    m = make_monitor(rx)
    with m.phase("forward"):
        with Span() as before:
            time.sleep(0.02)
        with Span() as save, m.phase("checkpoint"):  # nothing inside: the replay's shortcut
            time.sleep(0.03)
        with Span() as evaluation, m.phase("eval"):  # a barrier inside: not the eval's time
            time.sleep(0.01)
            with Span() as barrier:
                m.timed_collective(time.sleep, (0.02,), {}, async_index=1)
        with Span() as after:
            time.sleep(0.01)
    m.step(1)
    r = steps(rx, 1)[0]
    assert 0.03 <= phase(r, "checkpoint") <= save.seconds
    assert 0.02 <= phase(r, "sync") <= barrier.seconds
    assert 0.01 <= phase(r, "eval") <= evaluation.seconds - phase(r, "sync")
    assert 0.03 <= phase(r, "forward") <= before.seconds + after.seconds + 0.01
    assert sum(r.phase_seconds) <= r.step_seconds
    forward, backward = m.phase("forward"), m.phase("backward")
    forward.__enter__()
    time.sleep(0.01)
    with Span() as unclosed:
        backward.__enter__()                  # never exited: ends with the forward around it
        time.sleep(0.02)
        forward.__exit__(None, None, None)
    m.step(1)
    r = steps(rx, 2)[1]
    assert 0.02 <= phase(r, "backward") <= unclosed.seconds
    assert 0.01 <= phase(r, "forward") < 0.02 + 0.01 and sum(r.phase_seconds) <= r.step_seconds
    assert r.totals.internal_errors == 0
    m.shutdown()


def test_the_training_thread_only_queues_entries_the_records_thread_sends(rx):
    m = make_monitor(rx, flush_seconds=60)  # the records thread first flushes after 60 s
    with Span() as forward, m.phase("forward"):
        with Span() as custom, m.phase("my-eval"):  # nested, a custom name: counted as other
            time.sleep(0.01)
        time.sleep(0.01)
    m.step(8)
    time.sleep(0.1)
    assert m.sender.sent == 0 and len(m._entries) == 5  # nothing encoded or sent by step()
    m.flush()
    r = steps(rx, 1)[0]
    assert 0.01 <= phase(r, "other") <= custom.seconds
    assert 0.01 <= phase(r, "forward") and phase(r, "forward") + phase(r, "other") <= forward.seconds
    assert r.totals.internal_errors == 0
    m.shutdown()


def test_shutdown_wakes_the_sleeping_records_thread_at_once(rx):
    m = make_monitor(rx, flush_seconds=60)  # asleep for a minute unless shutdown wakes it
    m.step(8)
    time.sleep(0.05)  # the thread is in its sleep
    t0 = time.monotonic()
    m.shutdown()
    assert time.monotonic() - t0 < 1.0 and not m._thread.is_alive()
    assert wait_for(lambda: rx.of(EndRecord)) and len(steps(rx, 1)) == 1


class Collected:
    """A sender that keeps every datagram (the replay's output, byte for byte)."""

    def __init__(self):
        self.data, self.dropped, self.delivered = [], 0, (0, 0)

    def send(self, data, counts=None):
        self.data.append(data)
        return True

    def flush(self, timeout=0):
        pass

    def close(self):
        pass


class SlowFlush(Collected):
    """A sender whose ``flush()`` takes its time, as the real one's does while its retry queue
    drains into a daemon whose socket queue was full."""

    def flush(self, timeout=0):
        time.sleep(0.1)


def test_no_heartbeat_follows_the_end_record():
    """The daemon takes a heartbeat for a live rank: one after the end record clears the rank's
    end, and the rank that completed is expired as silent, read as lost (SyncwatchRankLost).
    The records thread stops before the end record goes, so nothing follows it, however long
    the sender takes to flush its last records."""
    sender = SlowFlush()
    m = Monitor(IDENT, sender, heartbeat_seconds=0.01)
    m.step(1)
    time.sleep(0.05)  # heartbeats under way
    m.shutdown()
    time.sleep(0.05)
    decoder = Decoder()
    kinds = [type(decoder.decode(data)).__name__ for data in sender.data]
    assert "HeartbeatRecord" in kinds and "StepRecord" in kinds
    assert kinds.index("EndRecord") == len(kinds) - 1, kinds


def random_entries(rng, steps):
    """Entries as the notes and hooks put them: nested phases, DDP marks, collectives, backward
    ends, steps."""
    from syncwatch.instrument.monitor import (COLL, COLL_END, DONE, ENDED, EXIT, LOADED, READY,
                                              SEQ, STEP, SYNCED)
    t, out = 0, []

    def mark():
        nonlocal t
        t += rng.randrange(1, 10_000)
        return t

    def phases(depth):
        for _ in range(rng.randrange(1, 5)):
            if rng.random() < 0.1:  # a bucket's collective done after its phase (wrapper path)
                out.extend([(READY, mark(), 1), (DONE, mark())])
            idx = rng.randrange(len(PHASE_INDEX))
            out.append((idx, mark()))
            inside = rng.random()
            if inside < 0.2:  # the last bucket (wrapper path) or a whole backward (hook-free)
                out.extend([(READY, mark(), rng.randrange(1, 4)), (rng.choice([DONE, SYNCED]), mark())])
            elif inside < 0.35:
                out.extend([(COLL, mark()), (SEQ,), (COLL_END, mark())])
            elif inside < 0.5 and depth < 2:
                phases(depth + 1)
            elif inside < 0.6:  # a backward under no_sync() ended
                out.append((ENDED, mark()))
            # backward ends at the next micro-batch's forward (zero-code mode), or at its exit
            end = LOADED if idx == PHASE_INDEX["backward"] and rng.random() < 0.5 else idx + EXIT
            out.append((end, mark()))

    for _ in range(steps):
        phases(0)
        out.append((STEP, mark(), 1.7e9 + t * 1e-9, rng.choice([0, 8]), rng.choice([None, 64]), None))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_a_burst_of_entries_replays_as_they_do_one_at_a_time(seed):
    """The records thread replays whatever accumulated since its last flush, with shortcuts for
    the usual shapes (a phase with nothing inside): records and heartbeat state must not depend
    on how the entries were batched."""
    import random
    entries = random_entries(random.Random(seed), 40)
    outcomes = []
    for chunk in (1, 7, len(entries)):
        m = Monitor(IDENT, Collected(), heartbeat_seconds=0, flush_seconds=3600)
        m.mark_backward_ends()  # as zero-code mode does: gradient syncs end backwards too
        for i in range(0, len(entries), chunk):
            m._entries.extend(entries[i:i + chunk])
            m.flush()
        outcomes.append((list(m.sender.data), m.phase_idx, m.phase_since, m.collective_sequence,
                         m.totals, m.errors))
        m.shutdown()
    assert len(outcomes[0][0]) == 40
    assert outcomes[0] == outcomes[1] == outcomes[2]


def test_a_records_thread_that_falls_behind_costs_bounded_memory(tmp_path, caplog):
    from syncwatch.instrument.monitor import MAX_ENTRIES
    m = Monitor(IDENT, Sender(str(tmp_path / "nobody.sock")), heartbeat_seconds=0,
                flush_seconds=60)
    for _ in range(MAX_ENTRIES + 10):
        m.step(1)
    assert len(m._entries) == MAX_ENTRIES  # the oldest entries went
    with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
        m.flush()
    assert m.errors == 1 and m.totals.steps == MAX_ENTRIES
    assert "OverflowError: the records thread fell behind" in caplog.text  # says what happened
    m.shutdown()


def test_a_forked_child_such_as_a_dataloader_worker_records_nothing(rx):
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the API is a no-op, nothing reaches the daemon
            ok = sw.current() is None and not _state.notes.bound
            sw.step(1)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with sw.phase("forward"):
            with sw.phase("my-eval"):  # a custom name, through Phases.__missing__ once
                pass
        assert "my-eval" in _state.phases  # remembered: no __missing__ call the next time
        assert sw.phase("my-eval") is sw.phase("other")
        sw.step(1)
        assert [r.identity.pid for r in steps(rx, 1)] == [os.getpid()]
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_an_evaluation_is_a_phase_of_its_own_in_steps_and_heartbeats(rx):
    """``sw.phase("eval")``: the protocol's eval phase (a planned pause), not ``other``; a
    heartbeat sent during it names it, which the stall alerts read."""
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        with sw.phase("forward"):
            time.sleep(0.01)
        sw.step(1)
        with Span() as evaluation, sw.phase("eval"):
            time.sleep(0.03)
            m.flush()
            m.heartbeat()
        sw.step(0)
        m.flush()
        r = steps(rx, 2)[1]
        assert 0.03 <= phase(r, "eval") <= evaluation.seconds, r.phase_seconds
        assert phase(r, "other") < 0.03, r.phase_seconds  # the eval is not other
        assert wait_for(lambda: rx.of(HeartbeatRecord))
        hb = rx.of(HeartbeatRecord)[-1]
        assert hb.phase == "eval" and 0.02 <= hb.phase_elapsed < 1.0, hb
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_daemon_absent_drops_and_counts(tmp_path):
    m = Monitor(IDENT, Sender(str(tmp_path / "nobody.sock")), heartbeat_seconds=0)
    for _ in range(5):
        m.step(1)
    m.flush()
    assert m.sender.dropped == 5 and m.totals.steps == 5
    m.shutdown()


# --------------------------------------------------------------------------- CUDA events

class FakeStream:
    """A device stream: the test enqueues work (ms) and lets the device run."""

    def __init__(self):
        self.enqueued = 0.0
        self.done = 0.0

    def launch(self, ms):
        self.enqueued += ms

    def run(self):
        self.done = self.enqueued


class FakeEvent:
    """Shaped like ``torch.cuda.Event(enable_timing=True)``."""
    created = 0

    def __init__(self, stream):
        FakeEvent.created += 1
        self.stream = stream
        self.t = None

    def record(self, stream=None):
        self.t = self.stream.enqueued

    def query(self):
        return self.t is not None and self.stream.done >= self.t

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.t - self.t

    def synchronize(self):
        raise AssertionError("synchronize() on the hot path")


def test_a_mark_records_on_the_current_stream_looked_up_by_device_and_handle():
    """A mark records on what ``torch.cuda.current_stream()`` would answer, looked up by the
    current device and the stream's raw handle, each stream object made once: a switch of
    stream (``torch.cuda.stream(side)``) or of device gives that stream, and the legacy default
    stream, handle 0 on every device, is each device's own. Past ``MOST_STREAMS`` the cache
    starts again, the answers right and the cache bounded."""
    state = {"device": 0, "raw": {0: 0, 1: 0}}
    made, recorded = [], []

    def make_stream(device):
        made.append((device, state["raw"][device]))
        return made[-1]

    def record(event, stream):
        recorded.append(stream)
        event.record(stream)

    calls = TorchCalls(lambda: state["device"], lambda d: state["raw"][d], make_stream, record,
                       lambda event: 0)
    clock = CudaEventClock(lambda: FakeEvent(FakeStream()), calls=calls)
    clock.MOST_STREAMS = 4

    def current():
        clock.mark()
        return recorded[-1]

    assert current() == (0, 0) and current() == (0, 0) and len(made) == 1
    state["raw"][0] = 0x7F00
    assert current() == (0, 0x7F00)
    state["raw"][0] = 0
    assert current() == (0, 0) and len(made) == 2  # back to the default stream: cached
    state["device"] = 1
    assert current() == (1, 0)
    for raw in (1, 2, 3):
        state["raw"][1] = raw
        assert current() == (1, raw) and len(clock._streams) <= 4
    state["device"] = 0
    assert current() == (0, 0) and len(made) == 7  # made again after the reset


def test_released_events_are_reused_on_their_own_device_only():
    """Threads marking on two devices (the training thread on device 0, autograd's on the
    model's device 1, where the script never called ``set_device``): an event goes back to the
    pool of the device it was recorded on, and torch's check that an event records on its own
    device's streams holds; with one pool, device 1's marks got device 0's events."""
    current = [0]

    class Event(FakeEvent):
        def __init__(self):
            super().__init__(FakeStream())
            self.device = None

        def record(self, stream=None):
            if self.device is not None and self.device != stream:
                raise RuntimeError(f"Event device {self.device} does not match recording "
                                   f"stream's device {stream}")
            self.device = stream
            super().record(stream)

    calls = TorchCalls(lambda: current[0], lambda d: 0, lambda d: d, FAKE_CALLS.record,
                       lambda event: event.device)
    clock = CudaEventClock(Event, calls=calls)
    for _ in range(20):
        marks = []
        for device in (0, 1, 1, 0):
            current[0] = device
            marks.append(clock.mark())
        for m in marks:
            clock.release(m)
    assert {d: len(p) for d, p in clock._pools.items()} == {0: 2, 1: 2}


def test_marks_record_on_the_ranks_gpu_whatever_the_threads_current_device():
    """The DDP tutorial's ``model.to(rank)`` without ``set_device``: the training thread's
    current device stays 0 while its work runs on the rank's GPU, on that thread's current
    stream of that GPU: the marks go there (on device 0's they timed nothing), and their events
    are reused."""
    recorded = []
    calls = TorchCalls(lambda: 0, lambda d: 0x50 + d, lambda d: ("stream of", d),
                       lambda event, stream: recorded.append(stream) or event.record(stream),
                       lambda event: 0)
    clock = CudaEventClock(lambda: FakeEvent(FakeStream()), device=1, calls=calls)
    for _ in range(3):
        clock.release(clock.mark())
    assert recorded == [("stream of", 1)] * 3 and len(clock._pools[1]) == 1


@pytest.mark.parametrize("current, count, env, gpu", [
    (0, 8, {"LOCAL_RANK": "3"}, 3),        # never set_device: the local rank's GPU
    (0, 4, {"LOCAL_RANK": "6"}, 2),        # modulo the GPUs visible
    (0, 8, {"SLURM_LOCALID": "5"}, 5),
    (3, 8, {"LOCAL_RANK": "3"}, 3),        # set_device(local_rank)
    (2, 8, {"LOCAL_RANK": "5"}, 2),        # set_device to another: the script's choice
    (0, 1, {"LOCAL_RANK": "3"}, 0),        # CUDA_VISIBLE_DEVICES: one GPU each
    (0, 8, {"LOCAL_RANK": "0"}, 0),
    (0, 8, {}, 0),
])
def test_the_ranks_gpu(current, count, env, gpu):
    assert ident_mod.rank_gpu(current, count, env) == gpu


def test_torch_calls_are_torchs_c_functions_where_torch_has_them(monkeypatch):
    """The mark's calls are torch's private C functions, each passed what torch's own
    ``Event.record()`` would: the device to ``_cuda_getCurrentRawStream`` and to
    ``current_stream``, the event and the stream object to ``_CudaEventBase.record``. (This CPU
    build lacks them: they are stood in for, to check the wiring.)"""
    torch = pytest.importorskip("torch")
    from syncwatch.instrument.clock import torch_calls
    log = []

    class Base:
        @staticmethod
        def record(event, stream):
            log.append(("record", event, stream))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: log.append("device") or 1,
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda d: log.append(("raw", d)) or 0x10, raising=False)
    monkeypatch.setattr(torch._C, "_CudaEventBase", Base, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: log.append(("stream", d)) or "s1")
    calls = torch_calls()
    assert calls.device is torch._C._cuda_getDevice and calls.record is Base.record
    clock = CudaEventClock(lambda: "ev", calls=calls)
    clock.mark()
    clock.mark()
    assert log == ["device", ("raw", 1), ("stream", 1), ("record", "ev", "s1"),
                   "device", ("raw", 1), ("record", "ev", "s1")]


def test_cuda_events_are_resolved_lazily_without_synchronize(rx):
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    for _ in range(2):
        with m.phase("forward"):
            dev.launch(10)
        with m.phase("backward"):
            dev.launch(5)
            m.bucket_ready()
            dev.launch(7)         # the all-reduce, ending after the slowest rank arrived
            m.bucket_done()
        m.step(8)
    time.sleep(0.05)
    assert rx.of(StepRecord) == []            # the device has not got there yet: nothing read
    dev.run()
    with m.phase("forward"):
        dev.launch(3)
    m.step(8)                                 # resolves steps 1 and 2, not 3
    recs = steps(rx, 2)
    time.sleep(0.05)
    assert [r.step for r in rx.of(StepRecord)] == [1, 2]
    for r in recs:
        assert phase(r, "forward") == pytest.approx(0.010)
        assert phase(r, "backward") == pytest.approx(0.005)
        assert r.wait_seconds == pytest.approx(0.007) == phase(r, "sync")
        assert r.step_seconds == pytest.approx(0.022)
    created = FakeEvent.created
    for _ in range(20):                       # events are recycled once resolved
        with m.phase("forward"):
            dev.launch(1)
        m.step(1)
        dev.run()
        m.flush()                             # the records thread, every flush_seconds
    assert FakeEvent.created - created <= 4
    m.shutdown()                              # resolves the rest by polling, never synchronize
    assert wait_for(lambda: len(rx.of(StepRecord)) == 23)
    assert [r.step for r in rx.of(StepRecord)] == list(range(1, 24))
    # every recycled event served one mark at a time: the first step starts at its first
    # phase's event, which is released once, not once as each
    assert [phase(r, "forward") for r in rx.of(StepRecord)[3:]] == [pytest.approx(0.001)] * 20
    assert [r.step_seconds for r in rx.of(StepRecord)[3:]] == [pytest.approx(0.001)] * 20
    pool = m.clock._pools[0]
    assert len({id(ev) for ev in pool}) == len(pool)


def test_cuda_gradient_wait_is_the_last_bucket_not_every_collective(rx):
    """On the device as on the host: the step's wait is DDP's gradient wait where there is one;
    the step's other blocking collectives are sync time too, but not the wait."""
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    with m.phase("forward"):
        dev.launch(10)
        m.timed_collective(dev.launch, (4,), {}, async_index=1)  # an all-gather of 4 ms
    with m.phase("backward"):
        dev.launch(5)
        m.bucket_ready()
        dev.launch(7)
        m.bucket_done()
    m.step(8)
    dev.run()
    m.shutdown()
    (r,) = steps(rx, 1)
    assert phase(r, "forward") == pytest.approx(0.010) and phase(r, "backward") == pytest.approx(0.005)
    assert phase(r, "sync") == pytest.approx(0.011)
    assert r.wait_seconds == pytest.approx(0.007)
    assert r.step_seconds == pytest.approx(0.026)


def test_cuda_step_with_two_gradient_syncs_waits_their_sum(rx):
    """On the device as on the host: each hook-free backward's wait (ready, then synced after
    DDP's finalize) is closed on its own, and the step waits their sum; the step is read once
    the last of them has passed."""
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    with m.phase("backward"):
        for compute, wait in ((5, 7), (3, 4)):  # the discriminator's, then the generator's
            dev.launch(compute)
            m.bucket_ready()
            dev.launch(wait)
            m.grads_synced()
    m.step(8)
    dev.run()
    m.shutdown()
    (r,) = steps(rx, 1)
    assert r.wait_seconds == pytest.approx(0.011) == phase(r, "sync")
    assert phase(r, "backward") == pytest.approx(0.008)
    assert r.step_seconds == pytest.approx(0.019)


@pytest.mark.parametrize("last", ["synced", "no_sync"])
def test_cuda_loading_between_micro_batches_is_data_and_its_events_are_recycled(rx, last):
    """Zero-code mode's gradient accumulation on the device: four micro-batches a step, the
    last three loaded (5 ms) after the backward before them; the last backward synchronized or
    not (every backward under ``no_sync()``), then clipped (1 ms). The loadings are ``data``, the
    clipping ``backward``, and the marks of the backwards' ends, used or not, go back to the
    pool."""
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    m.mark_backward_ends()
    backward = m.phase("backward")
    for step in range(20):
        for micro in range(4):
            with m.phase("forward"):
                dev.launch(2)
            backward.__enter__()
            dev.launch(3)
            if micro < 3:
                m.backward_ended()
                dev.launch(5)                      # the next micro-batch's loading
                m.next_micro_batch()
            elif last == "synced":
                m.bucket_ready()
                dev.launch(7)
                m.grads_synced()
            else:
                m.backward_ended()
        dev.launch(1)                              # clipping
        backward.__exit__(None, None, None)
        with m.phase("optimizer"):
            dev.launch(4)
        m.step(8)
        dev.run()
        m.flush()
        if step == 1:
            created = FakeEvent.created
    assert FakeEvent.created == created            # the pool's events serve every mark
    m.shutdown()
    recs = steps(rx, 20)
    sync = 0.007 if last == "synced" else 0.0
    for r in recs[1:]:
        assert phase(r, "data") == pytest.approx(0.015)
        assert phase(r, "forward") == pytest.approx(0.008)
        assert phase(r, "backward") == pytest.approx(0.013)
        assert phase(r, "sync") == pytest.approx(sync)
        assert r.step_seconds == pytest.approx(0.040 + sync)
    assert m.errors == 0 and not m._shared
    pool = m.clock._pools[0]
    assert len({id(ev) for ev in pool}) == len(pool)


class MovedClock(HostClock):
    """A host clock the test moves: a mark is its ``now``."""

    def __init__(self):
        self.now = 0

    def mark(self):
        return self.now


@pytest.mark.parametrize("device", ["host", "cuda"])
def test_random_phase_sequences_count_every_moment_once(rx, device):
    """Phases entered and left in any order (nested, left open, ended from outside them, across
    a step's end), blocking collectives and DDP gradient syncs inside and outside them, backward
    ends and next micro-batches' forwards (gradient accumulation in zero-code mode: ``backward``
    since the latest backward ended is ``data``), the records thread replaying at any point:
    each moment in a phase is that phase's time once, each wait is ``sync`` once, a step's
    gradient wait is its syncs' last buckets, and a step's phases fit in the step. Against a
    reference that follows the rules by hand (what comes before the first phase is no step's
    unless a step ends first). It found the waits of a step ending inside a phase, and a wrapped
    bucket's wait before a phase began, counted twice."""
    unit = 1e-9 if device == "host" else 1e-3   # ns on the host clock, ms of device time
    for seed in range(150):
        rng = random.Random(seed)
        if device == "host":
            clock = MovedClock()

            def advance(dt):
                clock.now += dt
        else:
            dev = FakeStream()
            clock = CudaEventClock(lambda: FakeEvent(dev))
            advance = dev.launch
        rx.records.clear()
        m = make_monitor(rx, clock=clock, flush_seconds=60)
        wrapped = rng.random() < 0.5  # buckets through ddp_hook_wrapper, or hook-free syncs
        m.mark_backward_ends()
        truth = dict.fromkeys(PHASE_INDEX, 0)
        stack, begun, before, before_waits = [], False, 0, []
        waits, step_waits = [], []  # each step's gradient waits
        # the time of the innermost phase since the latest backward ended, if one ended since
        # the last phase boundary (a phase's start or end, a step's end), else None
        tail = None

        def elapse(dt):  # in the innermost phase
            nonlocal tail
            advance(dt)
            if stack:
                truth[stack[-1]] += dt
                if tail is not None:
                    tail += dt

        def next_micro_batch():  # its forward (zero-code mode): backward ends
            nonlocal tail
            m.next_micro_batch()
            if "backward" in stack:
                k = max(i for i, name in enumerate(stack) if name == "backward")
                if k == len(stack) - 1 and tail is not None:  # since it ended: loading
                    truth["backward"] -= tail
                    truth["data"] += tail
                del stack[k:]
            tail = None

        def end_step():
            nonlocal begun, before, before_waits, step_waits, tail
            truth["sync"] += before      # a step before any phase: it runs from init()
            waits.append(sum(step_waits + before_waits))
            begun, before, before_waits, step_waits = True, 0, [], []
            m.step(1)
            tail = None

        def backward_ended():  # often followed by the next micro-batch's loading and forward
            nonlocal tail
            tail = 0
            r = rng.random()
            if r < 0.5:
                elapse(rng.randrange(1, 10**6))
                if r < 0.1:  # a step's end between: what ended before is the last step's
                    end_step()
                next_micro_batch()

        for _ in range(rng.randrange(5, 60)):
            r = rng.random()
            if r < 0.3:
                name = rng.choice(["data", "forward", "backward", "optimizer", "checkpoint",
                                   "eval", "mine", "backward", "backward"])  # micro-batches'
                stack.append(name if name in PHASE_INDEX else "other")
                m.phase(name).__enter__()
                begun, before, before_waits = True, 0, []  # the setup before it: no step's
                tail = None
            elif r < 0.5 and stack:
                k = len(stack) - 1 if rng.random() < 0.85 else rng.randrange(len(stack))
                k = max(i for i, name in enumerate(stack) if name == stack[k])  # the innermost
                m.phase(stack[k]).__exit__(None, None, None)                  # of its name
                del stack[k:]
                tail = None
            elif r < 0.54:  # a backward under no_sync() ended
                m.backward_ended()
                backward_ended()
            elif r < 0.6:
                next_micro_batch()
            elif r < 0.68:
                dt = rng.randrange(1, 10**6)
                m.timed_collective(advance, (dt,), {}, async_index=1)
                if begun:
                    truth["sync"] += dt
                else:
                    before += dt
            elif r < 0.74:  # a backward's buckets: the last one's wait is the sync's
                backward = object()
                for last in [False] * rng.randrange(3) + [True]:
                    m.bucket_ready(1, backward if wrapped else None)
                    dt = rng.randrange(1, 10**6)
                    advance(dt)
                    if not last:
                        if stack:          # an earlier bucket's all-reduce overlaps compute
                            truth[stack[-1]] += dt
                            if tail is not None:
                                tail += dt
                    elif begun:
                        truth["sync"] += dt
                        step_waits.append(dt)
                    else:
                        before += dt
                        before_waits.append(dt)
                    if wrapped:
                        m.bucket_done()
                if not wrapped:
                    m.grads_synced()
                    backward_ended()  # it ended there
            elif r < 0.8:
                end_step()
            else:
                elapse(rng.randrange(1, 10**6))
            if rng.random() < 0.2:
                if device == "cuda" and rng.random() < 0.7:
                    dev.run()
                m.flush()
        for name in reversed(stack):
            m.phase(name).__exit__(None, None, None)
        truth["sync"] += before
        waits.append(sum(step_waits + before_waits))
        m.step(1)
        if device == "cuda":
            dev.run()
        m.shutdown()
        recs = steps(rx, len(waits))
        assert len(recs) == len(waits), seed
        for r, wait in zip(recs, waits):
            assert sum(r.phase_seconds) <= r.step_seconds + 1e-9, (seed, r.step, r.phase_seconds)
            if wait:
                assert r.wait_seconds == pytest.approx(wait * unit, abs=1e-9), (seed, r.step)
        got = {name: sum(phase(r, name) for r in recs) for name in PHASE_INDEX}
        assert got == {name: pytest.approx(t * unit, abs=1e-9) for name, t in truth.items()}, seed
        assert m.errors == 0 and not m._shared, seed
        if device == "cuda":
            pool = m.clock._pools[0]
            assert len({id(ev) for ev in pool}) == len(pool), seed


def test_cuda_events_of_a_phase_inside_another(rx):
    """The event where an inner phase starts ends the outer phase's span and starts the inner's
    (its end likewise): shared by two spans, maybe of two steps' records, it goes back to the
    pool once both are released. Given back twice, two later marks recorded the same event."""
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    for _ in range(6):
        with m.phase("forward"):
            dev.launch(10)
            with m.phase("checkpoint"):
                dev.launch(5)
            dev.launch(3)
            with m.phase("eval"):          # a step ends inside it: the rest is the next step's
                dev.launch(2)
                m.step(1)
                dev.launch(4)
        dev.run()
        m.flush()
    m.step(1)                                 # the last eval's step: every span in a record
    dev.run()
    m.shutdown()
    assert wait_for(lambda: len(rx.of(StepRecord)) == 7)
    recs = rx.of(StepRecord)
    assert [phase(r, "forward") for r in recs] == [pytest.approx(0.013)] * 6 + [0.0]
    assert [phase(r, "checkpoint") for r in recs] == [pytest.approx(0.005)] * 6 + [0.0]
    assert [phase(r, "eval") for r in recs] == [pytest.approx(0.002)] + [pytest.approx(0.006)] * 5 + [
        pytest.approx(0.004)]
    assert [r.step_seconds for r in recs[1:6]] == [pytest.approx(0.024)] * 5
    pool = m.clock._pools[0]
    assert len({id(ev) for ev in pool}) == len(pool) and not m._shared


def test_cuda_events_of_a_first_phase_that_ends_after_the_first_step(rx):
    """The first step starts at its first phase's start event. Where that phase ends after the
    step (``step()`` called inside it), resolving the step gave the event back to the pool while
    the phase still held it: later marks re-recorded it, and the steps read 0 s optimizer phases,
    0 s steps, then an 11 ms one, with 6 ms steps and a 5 ms phase."""
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    for _ in range(6):
        with m.phase("optimizer"):  # the step's only phase, with step() inside it
            dev.launch(2)
            m.step(1)
            dev.launch(3)
        dev.launch(1)
        dev.run()
        m.flush()
    m.shutdown()
    assert wait_for(lambda: len(rx.of(StepRecord)) == 6)
    recs = rx.of(StepRecord)
    assert recs[0].step_seconds == pytest.approx(0.002)  # from the first phase's start
    assert [r.step_seconds for r in recs[1:]] == [pytest.approx(0.006)] * 5
    # each phase ends in the next step: its time up to the step's end is that step's
    assert [phase(r, "optimizer") for r in recs] == [pytest.approx(0.002)] + [pytest.approx(0.005)] * 5
    pool = m.clock._pools[0]
    assert len({id(ev) for ev in pool}) == len(pool)


def test_the_records_thread_binds_the_ranks_device_before_reading_events(rx):
    import threading
    dev = FakeStream()

    class Clock(CudaEventClock):
        def enter_thread(self):
            self.bound = threading.current_thread().name
    clock = Clock(lambda: FakeEvent(dev), device=3)
    m = make_monitor(rx, clock=clock)
    assert wait_for(lambda: getattr(clock, "bound", None) == "syncwatch-records")
    m.shutdown()


def test_cuda_tensor_amounts_are_read_once_computed_on_a_stream_of_their_own(rx):
    """``step(tokens=mask.sum())`` on a GPU: the tensor is read once its step's events have
    passed, on a side stream. Read on the current stream (as ``float()`` does), the copy waits
    behind all the work queued since: a collective hung on the device held the records thread,
    and with it the heartbeats of a rank that is alive."""
    import contextlib
    dev = FakeStream()
    current = ["default"]

    @contextlib.contextmanager
    def side_stream():
        current[0] = "side"
        try:
            yield
        finally:
            current[0] = "default"

    class FakeCudaTensor:
        """A one-element CUDA tensor computed by the work enqueued so far."""
        is_cuda = True

        def __init__(self, value):
            self.value, self.t = value, dev.enqueued

        def __float__(self):
            assert current[0] == "side", "copied on the current stream: waits for the hung work"
            assert dev.done >= self.t, "read before the device computed it"
            return float(self.value)

    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev), side_stream=side_stream))
    for n in (8, 16):
        with m.phase("forward"):
            dev.launch(10)
        m.step(FakeCudaTensor(n), tokens=FakeCudaTensor(100 * n))
    dev.launch(1000)          # the next step's collective, hung on the device: never done
    m.flush()
    assert rx.of(StepRecord) == []
    dev.done = 20.0           # the device got through the two steps
    m.flush()
    r1, r2 = steps(rx, 2)
    assert (r1.totals.samples, r1.totals.tokens) == (8, 800)
    assert (r2.totals.samples, r2.totals.tokens) == (24, 2400)
    assert m.errors == 0 and current[0] == "default"
    m.shutdown(timeout=0.05)


def test_cuda_steps_waiting_on_a_stuck_device_are_bounded(rx):
    dev = FakeStream()
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(dev)))
    for _ in range(100):
        dev.launch(1)
        m.step(1)
    m.flush()
    assert len(m._pending) == 64
    assert m.sender.dropped == 100 - 64  # the oldest steps went, counted as dropped records
    m.shutdown(timeout=0.05)


def test_a_phase_on_a_side_stream_behind_the_step_end_neither_stops_nor_skews_the_records(rx):
    main, side = FakeStream(), FakeStream()
    current = [side]  # the stream the events are recorded on: torch.cuda.stream(side) in a phase
    m = make_monitor(rx, clock=CudaEventClock(lambda: FakeEvent(current[0])), flush_seconds=0.01)
    with m.phase("data"):     # a prefetch: the next batch's copy on a side stream
        side.launch(50)
    current[0] = main
    with m.phase("forward"):
        main.launch(10)
    m.step(8)
    main.run()                # the step's end is passed, the side stream's copy is not
    time.sleep(0.1)           # the records thread read the step's end... and its phases
    side.run()
    for _ in range(2):
        with m.phase("forward"):
            main.launch(1)
        m.step(8)
    main.run()
    recs = steps(rx, 3)
    assert m._thread.is_alive() and m.errors == 0
    assert [r.step for r in recs] == [1, 2, 3] and phase(recs[0], "data") == pytest.approx(0.05)
    m.shutdown(timeout=0.05)


def test_a_step_whose_events_cannot_be_read_is_dropped_and_counted(rx, caplog):
    dev = FakeStream()
    created, broken = [], []

    class Event(FakeEvent):  # a CUDA error: elapsed_time raises whatever the events' state
        def __init__(self, stream):
            super().__init__(stream)
            created.append(self)

        def elapsed_time(self, end):
            if self in broken or end in broken:
                raise RuntimeError("CUDA error: invalid resource handle")
            return super().elapsed_time(end)

    m = make_monitor(rx, clock=CudaEventClock(lambda: Event(dev)), flush_seconds=0.01)
    with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
        with m.phase("forward"):
            dev.launch(10)
        broken.append(created[-1])  # the phase's end
        m.step(8)
        for _ in range(2):
            with m.phase("forward"):
                dev.launch(1)
            m.step(8)
        dev.run()
        recs = steps(rx, 2)
    assert m._thread.is_alive() and m.errors == 1 and m.sender.dropped == 1
    assert [r.step for r in recs] == [2, 3] and recs[-1].totals.internal_errors == 1
    assert "internal error" in caplog.text
    m.shutdown(timeout=0.05)


@pytest.mark.gpu
def test_cuda_event_clock_times_device_work():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    clock = CudaEventClock()
    a = clock.mark()
    torch.cuda._sleep(50_000_000)
    b = clock.mark()
    while not clock.ready(b):
        time.sleep(0.001)
    assert clock.elapsed(a, b) > 0.001
    assert ident_mod.cuda_uuid(0).startswith("GPU-")


@pytest.mark.gpu
def test_cuda_phases_are_timed_on_the_device_through_the_records_thread(rx):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = torch.cuda.device_count() - 1
    torch.cuda.set_device(gpu)
    m = make_monitor(rx, clock=CudaEventClock(device=gpu))
    for _ in range(3):
        with m.phase("forward"):
            torch.cuda._sleep(20_000_000)  # device work the host does not wait for
        m.step(1)
    recs = steps(rx, 3)
    assert all(phase(r, "forward") > 0.002 for r in recs)  # device time, not launch time
    assert m.errors == 0
    m.shutdown()


@pytest.mark.gpu
def test_a_cuda_tensor_amount_is_sent_while_later_device_work_runs(rx):
    """The step's record, whose tokens are a CUDA tensor, goes out while the device is still busy
    with work queued after it (standing in for a hung collective): the records thread reads the
    tensor on a stream of its own, not behind that work."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = torch.cuda.device_count() - 1
    torch.cuda.set_device(gpu)
    m = make_monitor(rx, clock=CudaEventClock(device=gpu))
    with m.phase("forward"):
        tokens = torch.ones(100, device=f"cuda:{gpu}").sum()
    m.step(4, tokens=tokens)
    torch.cuda._sleep(4_000_000_000)  # seconds of later work on the current stream
    later = torch.cuda.Event()
    later.record()
    try:
        (r,) = steps(rx, 1)
        assert r.totals.tokens == 100 and m.errors == 0
        assert not later.query()  # sent before the later work was done
    finally:
        torch.cuda.synchronize()
        m.shutdown()


# --------------------------------------------------------------------------- identity, API, CLI

def test_identity_from_torchrun_slurm_and_kubernetes():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run 42!",
           "TORCHELASTIC_RESTART_COUNT": "2", "NODE_NAME": "gpu-node-7"}
    i = ident_mod.resolve(env=env)
    assert (i.rank, i.local_rank, i.world_size, i.attempt) == (5, 1, 8, 2)
    assert i.train_job == "run_42_" and i.node == "gpu-node-7"
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16",
             "SLURM_JOB_ID": "777", "SLURM_RESTART_COUNT": "1", "SYNCWATCH_NODE": "n9"}
    i = ident_mod.resolve(env=slurm)
    assert (i.rank, i.local_rank, i.world_size, i.attempt, i.train_job, i.node) == (
        3, 3, 16, 1, "777", "n9")
    i = ident_mod.resolve(env={"SYNCWATCH_JOB": "mine", "TORCHELASTIC_RUN_ID": "x"})
    assert i.train_job == "mine" and i.attempt == 0
    assert ident_mod.resolve(env={}).train_job.startswith("job-")
    i.encode()  # valid for the protocol


def test_a_long_label_is_cut_with_its_hash_so_names_alike_in_their_first_128_stay_apart():
    """Label values were cut at 128 characters: two runs of a sweep named by their parameters
    (147 characters, differing after the 128th) were one train job, and on a shared node the
    daemon rejected one run's records as identity_conflict."""
    a = "sweep-" + "lr=0.001-wd=0.1-" * 8 + "seed=1"
    b = a[:-1] + "2"
    ja, jb = (ident_mod.resolve(env={"SYNCWATCH_JOB": j}).train_job for j in (a, b))
    assert len(a) > 128 and a[:128] == b[:128]
    assert ja != jb and len(ja) == len(jb) == 128 and ja[:119] == jb[:119] == a[:119]
    assert ja == ident_mod.resolve(env={"SYNCWATCH_JOB": a}).train_job  # every rank alike
    node = ident_mod.resolve(env={"SYNCWATCH_NODE": "n" * 300}).node
    assert len(node) == 128 and node.startswith("n" * 119 + "-")
    for name in ("x" * 128, "run 42!"):  # within 128 characters: cut nothing, hash nothing
        assert ident_mod.sanitize(name, "job") == name.replace(" ", "_").replace("!", "_")
    ident_mod.resolve(env={"SYNCWATCH_JOB": a, "SYNCWATCH_NODE": "n" * 300}).encode()


def test_attempt_rises_at_every_restart_of_slurm_and_of_torchrun_inside_it():
    """Under Slurm with torchrun inside, a requeue restarts torchrun, whose restart count starts
    at 0 again: the attempt went back (2 -> 0), and the daemon took the new attempt's records for
    stale ones of an older attempt. Slurm's count orders the launches, torchrun's within one."""
    launches = [(s, t) for s in range(3) for t in range(4)]  # torchrun --max-restarts 3
    attempts = [ident_mod.attempt_from_env({
        "SLURM_RESTART_COUNT": str(s), "TORCHELASTIC_RESTART_COUNT": str(t),
        "TORCHELASTIC_MAX_RESTARTS": "3"}) for s, t in launches]
    assert attempts == list(range(12))
    assert ident_mod.attempt_from_env({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert ident_mod.attempt_from_env({"SLURM_RESTART_COUNT": "2"}) == 2
    assert ident_mod.attempt_from_env({"SYNCWATCH_ATTEMPT": "7", "SLURM_RESTART_COUNT": "2",
                                       "TORCHELASTIC_RESTART_COUNT": "1"}) == 7
    # the protocol's bound: beyond it the attempt stays at the last value it allows
    huge = ident_mod.resolve(env={"SLURM_RESTART_COUNT": "5", "TORCHELASTIC_RESTART_COUNT": "1",
                                  "TORCHELASTIC_MAX_RESTARTS": "1000000"})
    assert huge.attempt == MAX_ATTEMPT - 1
    huge.encode()  # valid for the protocol
    assert ident_mod.attempt_from_env({"SYNCWATCH_ATTEMPT": str(MAX_ATTEMPT)}) == MAX_ATTEMPT - 1


def test_torchruns_placeholder_run_id_names_no_job():
    # torchrun exports TORCHELASTIC_RUN_ID=none for a multi-node job launched without --rdzv-id
    # (or with --master-port): every such job was labelled "none", and hid Slurm's job id
    assert ident_mod.job_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert ident_mod.job_from_env({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4242"}) == "4242"
    assert ident_mod.resolve(env={"TORCHELASTIC_RUN_ID": "none"}).train_job.startswith("job-")
    assert ident_mod.job_from_env({"TORCHELASTIC_RUN_ID": "nonesuch"}) == "nonesuch"


@needs_torch
@pytest.mark.parametrize("ending, reason", [
    ("sys.exit(0)", "completed"), ("raise ValueError('diverged')", "failed"),
    ("sys.exit('loss is NaN')", "failed"),
    ("raise KeyboardInterrupt", "interrupted"),
    ("threading.Thread(target=sys.exit, args=(3,)).start()", "completed")])
def test_the_end_record_says_how_the_process_ended(rx, ending, reason):
    """An uncaught exception ends the rank ``failed``, as does ``sys.exit`` with a failure
    status: atexit cannot tell that from a clean end, and SyncwatchRankLost leaves out ranks
    that completed. A thread's ``sys.exit`` ends the thread, not the process."""
    code = ("import sys, threading, torch, torch.distributed as dist\n"
            "import syncwatch.instrument as sw\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "sw.init()\n"
            "sw.step(1)\n"
            f"{ending}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(SYNCWATCH_SOCKET=rx.path, SYNCWATCH_JOB="ending"))
    assert wait_for(lambda: rx.of(EndRecord)), out.stderr[-2000:]
    (end,) = rx.of(EndRecord)
    assert (end.reason, end.last_step) == (reason, 1), out.stderr[-2000:]


@pytest.mark.parametrize("reason", ["crashed", None])
def test_shutdown_with_a_reason_the_protocol_has_not_still_sends_the_end_record(rx, caplog,
                                                                              reason):
    """``shutdown("crashed")``: the protocol has three end reasons, and encoding another raised
    inside shutdown, so no end record was sent at all (an internal error logged instead) and the
    daemon took the rank for lost. The record goes as ``failed``, with a warning naming the
    three."""
    m = make_monitor(rx)
    m.step(1)
    with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
        m.shutdown(reason)
    assert wait_for(lambda: rx.of(EndRecord))
    (end,) = rx.of(EndRecord)
    assert (end.reason, end.last_step) == ("failed", 1)
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"shutdown(reason={reason!r}) refused, sent as 'failed'" in said
    assert "completed, failed, interrupted" in said


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the test environment; its output as text."""
    return subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


def test_api_is_a_noop_without_torch_distributed():
    code = ("import sys, syncwatch.instrument as sw\n"
            "assert 'torch' not in sys.modules and 'prometheus_client' not in sys.modules\n"
            "with sw.phase('forward'): pass\n"
            "sw.step(3); sw.shutdown()\n"
            "assert sw.init() is None and sw.current() is None\n"
            "print('ok')\n")
    out = run_python(code)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("launched", [True, False])
def test_init_before_init_process_group_in_a_launched_rank_says_so(monkeypatch, caplog, launched):
    """``init()`` before ``init_process_group()`` in a rank that torchrun (or any env://
    launcher: ``WORLD_SIZE``) started: the rank trained unmonitored without a word, the same
    silence as a plain one-process run, where it stays a no-op quietly."""
    torch = pytest.importorskip("torch")
    import syncwatch.instrument as sw
    assert not torch.distributed.is_initialized()
    if launched:
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
        assert sw.init(job="early") is None and sw.current() is None
    said = [r.getMessage() for r in caplog.records]
    if launched:
        assert len(said) == 1 and "init() before torch.distributed.init_process_group()" in said[0]
    else:
        assert said == []


def test_syncwatch_run_environment_and_errors(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    run_mod.add_arguments(parser)
    args = parser.parse_args(["--socket", "/s.sock", "--skew-every", "10", "torchrun",
                              "--nproc-per-node", "4", "train.py"])
    assert args.command == ["torchrun", "--nproc-per-node", "4", "train.py"]
    env = run_mod.child_env(args, {"PYTHONPATH": "/mine"})
    assert env["SYNCWATCH_SOCKET"] == "/s.sock" and env["SYNCWATCH_SKEW_EVERY"] == "10"
    assert env["PYTHONPATH"].split(os.pathsep) == [run_mod.SITE_DIR, "/mine"]
    assert env["SYNCWATCH_PACKAGE_ROOT"] == run_mod.PACKAGE_ROOT
    assert "SYNCWATCH_JOB" not in env
    assert run_mod.main([]) == 2
    assert run_mod.main(["/nonexistent/trainer"]) == 127
    out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", sys.executable, "-c",
                          "import sys; print('syncwatch.instrument.auto' in sys.modules)"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_syncwatch_run_says_126_for_a_command_it_cannot_execute(tmp_path):
    """A command that is there but cannot be run (no execute bit, a directory) exits 126, as
    the shell and ``env`` say it; 127 stays for one not found. Both were 127."""
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    for command, code in ((script, 126), (tmp_path, 126), (tmp_path / "absent.py", 127)):
        out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", str(command)],
                             env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == code, (command, out.stderr)
        assert out.stderr.startswith(f"syncwatch-run: cannot run '{command}': ")
        assert len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize("option, says", [
    (["--udp", "bogus"], "--udp: UDP address must look like 127.0.0.1:9478, got 'bogus'"),
    (["--socket", "/" + "s" * 107], f"--socket: socket path /{'s' * 107} is 108 bytes; a Unix "
                                    "socket path has at most 107: choose a shorter one"),
    (["--heartbeat", "0"], "--heartbeat must be a positive number of seconds, got 0"),
    (["--skew-every", "-1"], "--skew-every must be 0 (off) or a number of steps, got -1"),
    (["--skew-seconds", "nan"], "--skew-seconds must be 0, a positive number or inf, got nan"),
])
def test_syncwatch_run_refuses_a_bad_option_before_running_the_command(tmp_path, option, says):
    """A bad ``--udp`` was handed to the ranks, each of which printed a traceback and trained
    unmonitored; a ``--socket`` too long for a Unix socket made every rank drop every record
    without a word; a heartbeat of 0 or a negative K quietly turned heartbeats or the exchange
    off. Refused in one line, and the command never runs."""
    ran = tmp_path / "ran"
    out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", *option, "touch",
                          str(ran)], env=subprocess_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr == f"syncwatch-run: {says}\n" and not ran.exists()


@pytest.mark.parametrize("var, value, says", [
    ("SYNCWATCH_UDP", "bogus", "--udp (from SYNCWATCH_UDP): UDP address must look like "
                               "127.0.0.1:9478, got 'bogus'"),
    ("SYNCWATCH_SOCKET", "/" + "s" * 107, f"--socket (from SYNCWATCH_SOCKET): socket path "
                                          f"/{'s' * 107} is 108 bytes; a Unix socket path has at "
                                          "most 107: choose a shorter one"),
    ("SYNCWATCH_HEARTBEAT", "0", "--heartbeat (from SYNCWATCH_HEARTBEAT) must be a positive "
                                 "number of seconds, got 0"),
    ("SYNCWATCH_SKEW_EVERY", "-1", "--skew-every (from SYNCWATCH_SKEW_EVERY) must be 0 (off) or "
                                   "a number of steps, got -1"),
    ("SYNCWATCH_SKEW_SECONDS", "nan", "--skew-seconds (from SYNCWATCH_SKEW_SECONDS) must be 0, a "
                                      "positive number or inf, got nan"),
])
def test_syncwatch_run_names_the_variable_a_bad_value_came_from(tmp_path, var, value, says):
    """A bad value from a ``SYNCWATCH_*`` variable was told by its flag alone (``--udp: UDP
    address must look like ...``): a job that only inherited the variable (a cluster-wide
    default) typed no such flag. The error names the variable as well."""
    ran = tmp_path / "ran"
    out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", "touch", str(ran)],
                         env=subprocess_env(**{var: value}), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr == f"syncwatch-run: {says}\n" and not ran.exists()


def test_syncwatch_run_names_only_the_flag_that_won_over_its_variable():
    _, out = _run_env("--heartbeat", "-1", SYNCWATCH_HEARTBEAT="0")
    assert out.returncode == 2 and out.stderr == ("syncwatch-run: --heartbeat must be a positive "
                                                  "number of seconds, got -1\n")


@pytest.mark.parametrize("option, env", [(["--skew-seconds", "inf"], {}),
                                         ([], {"SYNCWATCH_SKEW_SECONDS": "inf"})])
def test_syncwatch_run_passes_skew_seconds_of_inf_to_the_command(option, env):
    """``SYNCWATCH_SKEW_SECONDS=inf`` keeps windows of K (docs/instrumentation.md), as the ranks
    read it: ``syncwatch-run`` refused it, flag or twin alike, and the training command never ran."""
    out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", *option, "--",
                          sys.executable, "-c",
                          "import os; print(os.environ['SYNCWATCH_SKEW_SECONDS'])"],
                         env=subprocess_env(**env), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "inf\n", out.stderr


def _run_env(*args, **env):
    """The ``SYNCWATCH_*`` variables and ``PYTHONPATH`` the command of ``syncwatch-run args``
    sees, and the run's result."""
    out = subprocess.run([sys.executable, "-m", "syncwatch.instrument.run", *args, "--",
                          sys.executable, "-c", "import json, os; print(json.dumps(dict("
                          "(k, v) for k, v in os.environ.items() if k.startswith('SYNCWATCH_')"
                          " or k == 'PYTHONPATH')))"],
                         env=subprocess_env(**env), capture_output=True, text=True, timeout=60)
    return (json.loads(out.stdout) if out.returncode == 0 else None), out


def test_syncwatch_run_socket_flag_wins_over_an_inherited_udp_variable():
    """``--socket`` given while ``SYNCWATCH_UDP`` is set (a cluster-wide default): the ranks,
    which take UDP first, sent there and the flag was ignored without a word. A flag wins over
    its variables, as every other flag does."""
    env, out = _run_env("--socket", "/tmp/mine.sock", SYNCWATCH_UDP="10.0.0.5:9478")
    assert env is not None, out.stderr
    assert env["SYNCWATCH_SOCKET"] == "/tmp/mine.sock" and "SYNCWATCH_UDP" not in env
    # and it is checked as the socket the ranks will use
    _, out = _run_env("--socket", "/" + "s" * 107, SYNCWATCH_UDP="10.0.0.5:9478")
    assert out.returncode == 2 and out.stderr.startswith("syncwatch-run: --socket: socket path")
    # --udp over SYNCWATCH_SOCKET: UDP, as before
    env, out = _run_env("--udp", "10.0.0.5:9478", SYNCWATCH_SOCKET="/tmp/theirs.sock")
    assert env is not None and env["SYNCWATCH_UDP"] == "10.0.0.5:9478", out.stderr


def test_syncwatch_run_refuses_both_socket_and_udp():
    """``--socket`` and ``--udp`` together: the ranks sent over UDP, the socket ignored without a
    word. Refused in one line (after argparse's usage), the command never run."""
    env, out = _run_env("--socket", "/tmp/mine.sock", "--udp", "10.0.0.5:9478")
    assert env is None and out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == ("syncwatch-run: error: argument --udp: not allowed "
                                           "with argument --socket")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("var", ["SYNCWATCH_UDP", "SYNCWATCH_HEARTBEAT", "SYNCWATCH_SKEW_EVERY",
                                 "SYNCWATCH_SKEW_SECONDS", "SYNCWATCH_SOCKET", "SYNCWATCH_JOB"])
def test_syncwatch_run_takes_an_empty_variable_as_unset(var):
    """An empty ``SYNCWATCH_*`` variable (``export SYNCWATCH_UDP=``, a manifest's ``value: ""``)
    is unset to the ranks, which take the default; ``syncwatch-run`` refused it (``--udp: UDP
    address must look like ..., got ''``, ``SYNCWATCH_HEARTBEAT='': could not convert``), exit
    2, and the command never ran."""
    env, out = _run_env(**{var: ""})
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert env.get(var, "") == ""


@pytest.mark.parametrize("user, child", [
    (":/mine", ["", "/mine"]), ("/mine:", ["/mine", ""]), ("/a::/b", ["/a", "", "/b"]),
    ("", []), ("/mine", ["/mine"])])
def test_syncwatch_run_keeps_the_empty_entries_of_the_users_pythonpath(user, child):
    """An empty entry of ``PYTHONPATH`` is the current directory (``PYTHONPATH=$PYTHONPATH:/x``
    with none set before gives ``:/x``); ``syncwatch-run`` dropped it, and a script run from
    the repository root (``python scripts/train.py``) could no longer import the repository's
    packages. The user's entries are kept as they are, behind the ``sitecustomize``'s."""
    parser = __import__("argparse").ArgumentParser()
    run_mod.add_arguments(parser)
    env = run_mod.child_env(parser.parse_args(["python"]), {"PYTHONPATH": user})
    assert env["PYTHONPATH"].split(os.pathsep) == [run_mod.SITE_DIR, *child]
    # run under syncwatch-run again: its directory once
    again = run_mod.child_env(parser.parse_args(["python"]), env)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]


@pytest.mark.parametrize("fails", [False, True])
def test_syncwatch_run_chains_the_users_sitecustomize_and_reports_its_error(tmp_path, fails):
    """A ``sitecustomize`` already on the path runs after syncwatch's. One that raised was
    silenced, where Python itself says ``Error in sitecustomize`` and the cause: now it says
    so under ``syncwatch-run`` too, and the program starts all the same, instrumented."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITE_RAN'] = '1'\n"
        + ("raise RuntimeError('no cluster config')\n" if fails else ""))
    parser = __import__("argparse").ArgumentParser()
    run_mod.add_arguments(parser)
    env = run_mod.child_env(parser.parse_args(["python"]), subprocess_env(PYTHONPATH=str(site)))
    out = subprocess.run([sys.executable, "-c", "import os, sys; print(os.environ.get("
                          "'USER_SITE_RAN'), 'syncwatch.instrument.auto' in sys.modules)"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "1 True\n", out.stderr
    assert out.stderr == ("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                          "RuntimeError: no cluster config\n" if fails else "")


def test_syncwatch_run_from_another_environment_shadows_none_of_the_programs_modules(
        tmp_path, monkeypatch):
    """syncwatch-run installed in its own environment (pipx, a tools venv) runs a program whose
    environment has no syncwatch. Its ``site-packages`` holds other packages too, here a stale
    PyPI ``pathlib``: the program gets the standard library's, and syncwatch all the same."""
    tools = tmp_path / "tools-site-packages"
    tools.mkdir()
    (tools / "syncwatch").symlink_to(os.path.join(run_mod.PACKAGE_ROOT, "syncwatch"))
    (tools / "pathlib.py").write_text("raise ImportError('the stale pathlib from PyPI')\n")
    monkeypatch.setattr(run_mod, "PACKAGE_ROOT", str(tools))
    program_env = tmp_path / "program-venv"  # no syncwatch, no torch
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(program_env)], check=True,
                   timeout=120)
    parser = __import__("argparse").ArgumentParser()
    run_mod.add_arguments(parser)
    env = run_mod.child_env(parser.parse_args(["python"]), {"PATH": os.environ["PATH"]})
    code = ("import pathlib, sys\n"
            "print(pathlib.__file__.startswith(sys.base_prefix))\n"
            "print(sys.modules['syncwatch.instrument.auto'].__file__)\n"
            "print(any(p.endswith('tools-site-packages') for p in sys.path))\n")
    out = subprocess.run([str(program_env / "bin" / "python"), "-c", code], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stdlib, auto, on_path = out.stdout.split("\n")[:3]
    assert stdlib == "True"
    assert auto == str(tools / "syncwatch" / "instrument" / "auto.py")
    assert on_path == "False"
    assert out.stderr == ""
    env.pop("SYNCWATCH_PACKAGE_ROOT")  # the PYTHONPATH alone, carried into another environment
    out = subprocess.run([str(program_env / "bin" / "python"), "-c", "print('ran')"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "ran\n" and "syncwatch not found" in out.stderr


@needs_torch
def test_zero_code_install_after_torch_imported_fsdp_patches_what_the_script_imports():
    """``install()`` after FSDP was imported (not how ``syncwatch-run`` runs it, but a script
    may call it late): the names the script imports next are the patched ones."""
    code = ("import torch.distributed.fsdp as f\n"
            "from syncwatch.instrument import auto\n"
            "auto.install()\n"
            "from torch.distributed.fsdp import fully_shard, FullyShardedDataParallel\n"
            "from torch.nn.parallel import DistributedDataParallel\n"
            "from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState\n"
            "from torch.distributed.fsdp import _runtime_utils\n"
            "print(fully_shard._syncwatch_original is not None, hasattr(fully_shard, 'state'),\n"
            "      FullyShardedDataParallel._syncwatch_patched,\n"
            "      DistributedDataParallel._syncwatch_patched,\n"
            "      hasattr(FSDPState._root_post_backward_final_callback, '_syncwatch_original'),\n"
            "      hasattr(_runtime_utils._post_backward_final_callback, '_syncwatch_original'),\n"
            "      hasattr(__import__('torch').optim.Adam.load_state_dict, '_syncwatch_original'))\n")
    out = run_python(code)
    assert out.stdout.split() == ["True"] * 7, out.stderr[-2000:]


@needs_torch
def test_zero_code_install_patches_the_rest_where_a_torch_moved_what_one_patch_wraps():
    """Some patches wrap torch's private functions (FSDP's end-of-backward callbacks), which a
    torch release may move: that patch is skipped with a warning naming its module, and the ones
    after it (DDP's, ``torch.save``) are in place all the same; one failure skipped them all."""
    code = ("import torch.distributed.fsdp, torch.nn.parallel\n"
            "from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState\n"
            "del FSDPState._root_post_backward_final_callback\n"
            "from syncwatch.instrument import auto\n"
            "auto.install()\n"
            "from torch.distributed.fsdp import _runtime_utils\n"
            "print(torch.nn.parallel.DistributedDataParallel._syncwatch_patched,\n"
            "      hasattr(torch.save, '_syncwatch_original'),\n"
            "      hasattr(_runtime_utils._post_backward_final_callback, '_syncwatch_original'))\n")
    out = run_python(code)
    assert out.stdout.split() == ["True"] * 3, out.stderr[-2000:]
    assert ("could not patch torch.distributed.fsdp._fully_shard._fsdp_state" in out.stderr
            and "_root_post_backward_final_callback" in out.stderr), out.stderr[-2000:]


@needs_torch
@pytest.mark.parametrize("wrap", ["DistributedDataParallel({})",
                                  "FullyShardedDataParallel({}, device_id=torch.device('cpu'))"],
                         ids=["ddp", "fsdp"])
def test_zero_code_keeps_no_model_the_script_lets_go_of(wrap):
    """Zero-code mode attaches to every model built, out of the script's sight: one the script
    drops (a sweep, a cross-validation fold, a retry in the same process) must be freed then, not
    when the next one is built, with the one after it already in memory."""
    code = ("import gc, os, weakref\n"
            "from syncwatch.instrument import auto\n"
            "auto.install()\n"
            "import torch, torch.distributed as dist\n"
            "from torch.distributed.fsdp import FullyShardedDataParallel\n"
            "from torch.nn.parallel import DistributedDataParallel\n"
            "torch.set_num_threads(1)\n"
            "os.environ['SYNCWATCH_SOCKET'] = '/nonexistent/ingest.sock'\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            f"model = {wrap.format('torch.nn.Linear(8, 8)')}\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n"
            "    model(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
            "steps, gone = auto._steps.steps, weakref.ref(model)\n"
            "del model, opt\n"
            "gc.collect()\n"
            "print(steps, gone() is None)\n")
    out = run_python(code)
    assert out.stdout.split() == ["3", "True"], out.stderr[-2000:]


ZERO_CODE_PREAMBLE = ("from syncwatch.instrument import auto\n"
                      "auto.install()\n"
                      "import torch, torch.distributed as dist\n"
                      "from torch.nn.parallel import DistributedDataParallel\n"
                      "torch.set_num_threads(1)\n"
                      "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, "
                      "world_size=1)\n")


def run_zero_code(rx, script: str, imports: str = "") -> str:
    """Run ``script`` as one rank under zero-code mode (``imports`` first, before syncwatch
    patches anything), reporting to ``rx``; assert it succeeded, return what it printed."""
    return zero_code_process(rx, script, imports).stdout


def zero_code_process(rx, script: str, imports: str = "", **env) -> subprocess.CompletedProcess:
    """``run_zero_code``'s process, its output and its warnings (stderr)."""
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", imports + ZERO_CODE_PREAMBLE + script],
                         capture_output=True, text=True,
                         env=subprocess_env(SYNCWATCH_SOCKET=rx.path, **env), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_zero_code_counts_the_steps_and_samples_of_a_second_run_in_the_same_process(rx):
    """A sweep, a cross-validation, a retry: a new model and optimizer once the first are gone.
    Their steps end and count their samples; held by ``id``, only the first run's did (the new
    run's first step never ended, and the rank read as stalled)."""
    run_zero_code(rx, "for run in range(2):\n"
                      "    model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "    for _ in range(3):\n"
                      "        model(torch.randn(5, 8)).sum().backward()\n"
                      "        opt.step(); opt.zero_grad()\n"
                      "    del model, opt\n"
                      "    gc.collect()\n", imports="import gc\n")
    recs = steps(rx, 6)
    assert [r.step for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r.samples for r in recs] == [5.0] * 6


@pytest.mark.parametrize(("state", "count"), [
    ({"state": {3: {"step": 7.0, "exp_avg": None}}, "param_groups": [{"lr": 0.1}]}, 7),
    ({"state": {}, "param_groups": [{"lr": 0.1, "step": 12}]}, 12),  # kept by the group
    ({"state": {0: {"momentum_buffer": None}}, "param_groups": [{"lr": 0.1}]}, None),  # SGD
    ({"state": {0: {"step": -1}}}, None),
    ({"state": {0: {"step": 2.5}}}, None),
    ({"state": {0: {"step": [1, 2]}}}, None),
    ({"state": {0: {"step": "7"}}}, None),
    ({"state": {0: {"step": "soon"}}}, None),
    ({"state": [1, 2], "param_groups": None}, None),
    ("not a state", None),
])
def test_loaded_step_reads_the_count_of_steps_an_optimizer_state_holds(state, count):
    from syncwatch.instrument import auto
    assert auto.loaded_step(state) == count


@pytest.mark.parametrize(("optimizer", "numbers"), [
    ("AdamW(params, lr=0.1)", [8, 9, 10, 8, 9]),
    ("AdamW(params, lr=0.1, fused=True)", [8, 9, 10, 8, 9]),
    ("Adagrad(params, lr=0.1)", [8, 9, 10, 8, 9]),
    ("SGD(params, lr=0.1, momentum=0.9)", [1, 2, 3, 4, 5]),  # its state counts no steps
])
def test_zero_code_numbers_the_steps_on_from_the_optimizer_state_a_job_resumes_from(
        rx, optimizer, numbers):
    """A job that loads its optimizer's state from a checkpoint of step 7 goes on at step 8;
    loaded again mid-run (a resume within the process), the step number goes back, a new
    attempt. An optimizer whose state keeps no step count leaves the steps counted from 1."""
    run_zero_code(rx, "def make(model):\n"
                      "    params = model.parameters()\n"
                      f"    return torch.optim.{optimizer}\n"
                      "def train(model, opt, n):\n"
                      "    for _ in range(n):\n"
                      "        model(torch.randn(4, 8)).sum().backward()\n"
                      "        opt.step(); opt.zero_grad()\n"
                      "earlier = torch.nn.Linear(8, 8)  # the job before the restart\n"
                      "opt = make(earlier)\n"
                      "train(earlier, opt, 7)\n"
                      "saved = copy.deepcopy(opt.state_dict())\n"
                      "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "opt = make(model)\n"
                      "opt.load_state_dict(copy.deepcopy(saved))  # as from a file\n"
                      "train(model, opt, 3)\n"
                      "opt.load_state_dict(copy.deepcopy(saved))\n"
                      "train(model, opt, 2)\n", imports="import copy\n")
    recs = steps(rx, 5)
    assert [r.step for r in recs] == numbers
    resumed = numbers[3] < numbers[2]
    assert [r.identity.attempt for r in recs] == [0, 0, 0, 1, 1] if resumed else [0] * 5
    assert all(r.totals.internal_errors == 0 for r in recs)


@pytest.mark.parametrize("script", [
    # the explicit API under syncwatch-run, init() after the model: zero-code mode stood down
    "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "sw.init()\n"
    "train(model, opt)\n"
    "sw.shutdown()\n"
    "models = [model]\n",
    # two runs, each in a process group of its own: the first run's steps were stopped
    "models = []\n"
    "for run in range(2):\n"
    "    if run:\n"
    "        dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
    "    model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
    "    train(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
    "    models.append(model)\n"
    "    dist.destroy_process_group()\n",
], ids=["explicit-api-shut-down", "a-second-process-group"])
def test_zero_code_leaves_a_model_alone_once_its_monitor_is_shut_down(rx, script):
    """Forwards, a backward and a step after the monitor is gone: zero-code mode does nothing.
    Its hooks took a stopped monitor (None) for the current one (None too, once shut down) and
    called into it: AttributeError in the script's forward."""
    out = run_zero_code(rx, "def train(model, opt):\n"
                            "    for _ in range(2):\n"
                            "        model(torch.randn(4, 8)).sum().backward()\n"
                            "        opt.step(); opt.zero_grad()\n"
                            + script +
                            "for model in models:\n"
                            "    model.eval()\n"
                            "    with torch.no_grad():\n"
                            "        model(torch.randn(2, 8))\n"
                            "    model.train()\n"
                            "    model.module(torch.randn(2, 8)).sum().backward()\n"
                            "    torch.optim.SGD(model.parameters(), lr=0.1).step()\n"
                            "print('ok')\n", imports="import syncwatch.instrument as sw\n")
    assert out.strip().splitlines()[-1] == "ok"


def test_init_after_zero_code_started_says_which_arguments_it_ignores(rx):
    """The script's ``init(job=...)`` after its model under ``syncwatch-run``: the monitor goes
    on as started (records labelled with the environment's job, not ``mine``), and a warning
    names what is ignored; it was dropped without a word."""
    out = zero_code_process(rx, "import syncwatch.instrument as sw\n"
                                "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                "sw.init(job='mine', heartbeat_seconds=1)\n"
                                "sw.init()\n"
                                "model(torch.randn(4, 8)).sum().backward(); opt.step()\n"
                                "sw.step(4)\n", SYNCWATCH_JOB="from-env")
    assert out.stderr.count("ignores job, heartbeat_seconds;") == 1, out.stderr[-2000:]
    (rec,) = steps(rx, 1)
    assert rec.identity.train_job == "from-env"


def test_zero_code_counts_a_closure_s_batch_once_however_often_it_evaluates_it(rx):
    """LBFGS evaluates its closure (forward and backward of the same batch) up to ``max_iter``
    times in one ``step()``: each evaluation counted the batch again, 5 x 5 samples a step here
    (throughput read 5 times too high). The batch counts once per step."""
    run_zero_code(rx, "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)\n"
                      "for _ in range(3):\n"
                      "    x = torch.randn(5, 8)\n"
                      "    def closure():\n"
                      "        opt.zero_grad()\n"
                      "        loss = model(x).pow(2).sum()\n"
                      "        loss.backward()\n"
                      "        return loss\n"
                      "    opt.step(closure)\n")
    recs = steps(rx, 3)
    assert [r.samples for r in recs] == [5.0] * 3


def test_zero_code_times_a_second_optimizer_s_step_and_the_loading_after_it(rx):
    """A GAN stepping its discriminator first (the optimizer that ends the steps), then its
    generator: the generator's ``step()`` is ``optimizer``, and the next batch's loading after it
    (a 0.1 s sleep) is ``data``. Nothing switched at the second optimizer's step, and both read
    as ``backward`` (the phase since the discriminator's second forward)."""
    run_zero_code(rx, "G = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "D = DistributedDataParallel(torch.nn.Linear(8, 1))\n"
                      "oG = torch.optim.SGD(G.parameters(), lr=0.1)\n"
                      "oD = torch.optim.SGD(D.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n"
                      "    time.sleep(0.1)\n"
                      "    fake = G(torch.randn(6, 8))\n"
                      "    D(fake.detach()).mean().backward(); oD.step(); oD.zero_grad()\n"
                      "    D(fake).mean().backward(); oG.step(); oG.zero_grad()\n",
                  imports="import time\n")
    recs = steps(rx, 3)
    assert [r.samples for r in recs] == [6.0] * 3
    for r in recs[1:]:
        assert phase(r, "data") >= 0.1 and phase(r, "backward") < 0.1, r.phase_seconds
        assert sum(r.phase_seconds) <= r.step_seconds + 1e-6


# Four micro-batches per optimizer step, each loaded (a 20 ms sleep) before its forward, and a
# slow gradient clipping (30 ms) after the last backward: 4 steps with the first three
# micro-batches unsynchronized (``unsynced``: DDP's and FSDP's no_sync(), FSDP2's
# set_requires_gradient_sync(False)), then 4 with every backward synchronized. The script
# measures, per step, what each phase must hold at least (the sleeps inside it) and at most (the
# wall time of the statements its time can come from): bounds measured, not margins fixed, on a
# loaded machine.
ACCUMULATION_MODELS = {
    "ddp": "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
           "unsynced = model.no_sync\n",
    "fully_shard": "from torch.distributed.fsdp import fully_shard\n"
                   "model = fully_shard(torch.nn.Sequential(fully_shard(torch.nn.Linear(8, 8)),\n"
                   "                                        torch.nn.Linear(8, 8)))\n"
                   "@contextlib.contextmanager\n"
                   "def unsynced():\n"
                   "    model.set_requires_gradient_sync(False)\n"
                   "    yield\n"
                   "    model.set_requires_gradient_sync(True)\n",
    "fsdp": "from torch.distributed.fsdp import FullyShardedDataParallel\n"
            "model = FullyShardedDataParallel(torch.nn.Linear(8, 8),\n"
            "                                 device_id=torch.device('cpu'))\n"
            "unsynced = model.no_sync\n",
}
ACCUMULATION = """\
opt = torch.optim.SGD(model.parameters(), lr=0.1)
clock = time.perf_counter
before_step = None  # just before the previous step's opt.step(): its end is after this
for no_sync in (True, False):
    for step in range(4):
        loading = data_hi = clipping = backward_hi = 0.0
        for i in range(4):
            t0 = clock()
            time.sleep(0.02)                           # this micro-batch's loading
            t1 = clock()
            sync = i == 3 or not no_sync
            with contextlib.nullcontext() if sync else unsynced():
                out = model(torch.randn(5, 8))
                t2 = clock()
                if i or before_step:  # data: from the backward (or step) before to forward
                    loading += t1 - t0
                    data_hi += t2 - (before_backward if i else before_step)
                before_backward = clock()
                out.pow(2).sum().backward()
            t3 = clock()
            if i < 3:         # backward: from the end of forward to the end of backward
                backward_hi += t3 - t1
        t4 = clock()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        time.sleep(0.03)                               # a slow clipping
        clipping = clock() - t4
        before_step = clock()
        opt.step()
        backward_hi += clock() - t1                    # the last micro-batch's, with clipping
        opt.zero_grad()
        print(json.dumps(dict(loading=loading, data_hi=data_hi, clipping=clipping,
                              backward_hi=backward_hi)))
"""


@pytest.mark.parametrize("wrap", list(ACCUMULATION_MODELS))
def test_zero_code_times_the_loading_between_micro_batches_as_data(rx, wrap):
    """Gradient accumulation: what comes between a micro-batch's backward and the next
    micro-batch's forward (its loading) is ``data``, whether DDP or FSDP (both) synchronizes
    each backward or not; what comes between the last backward and the optimizer's step
    (gradient clipping) stays ``backward``. Nothing marked the end of a backward, and the three
    loadings between micro-batches read as ``backward``: 0.092 s of it, 0.020 s of ``data``,
    for 0.080 s of loading a step (FSDP's until its end-of-backward callback was wrapped)."""
    out = run_zero_code(rx, ACCUMULATION_MODELS[wrap] + ACCUMULATION,
                        imports="import contextlib, json, time\n")
    measured = [json.loads(line) for line in out.splitlines()]
    recs = steps(rx, 8)
    assert [r.samples for r in recs] == [20.0] * 8
    for r, got in zip(recs, measured):
        data, backward = phase(r, "data"), phase(r, "backward")
        assert got["loading"] <= data <= got["data_hi"], (r.step, data, got)
        assert got["clipping"] <= backward <= got["backward_hi"], (r.step, backward, got)
        assert sum(r.phase_seconds) <= r.step_seconds + 1e-6, r.phase_seconds
        assert r.totals.internal_errors == 0


def test_zero_code_times_only_the_training_threads_own_saves_as_checkpoint(rx):
    """What a save is under ``syncwatch-run``: on the training thread once the loop has started,
    ``checkpoint``, and then the phase it interrupted goes on (``data`` after a step, ``eval``
    within an evaluation); a save within a save (DCP writes with ``torch.save``) as one; a save
    before the first forward (setup) and one on another thread (an asynchronous checkpointer)
    no step's. Each timed save sleeps 0.1 s, each untimed one 0.4 s."""
    run_zero_code(rx, "class Slow(io.BytesIO):\n"
                      "    def __init__(self, delay): super().__init__(); self.delay = delay\n"
                      "    def write(self, b):\n"
                      "        if self.delay: time.sleep(self.delay); self.delay = 0\n"
                      "        return super().write(b)\n"
                      "class Nested(Slow):\n"
                      "    def write(self, b):\n"
                      "        if self.delay: torch.save(1, Slow(self.delay)); self.delay = 0\n"
                      "        return super().write(b)\n"
                      "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "torch.save(1, Slow(0.4))\n"
                      "for i in range(4):\n"
                      "    model(torch.randn(5, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
                      "    if i == 0: torch.save(1, Slow(0.1))\n"
                      "    if i == 1:\n"
                      "        model.eval()\n"
                      "        with torch.no_grad(): model(torch.randn(5, 8)); time.sleep(0.1)\n"
                      "        torch.save(1, Nested(0.1)); time.sleep(0.1)\n"
                      "        model.train()\n"
                      "    if i == 2:\n"
                      "        t = threading.Thread(target=torch.save, args=(1, Slow(0.4)))\n"
                      "        t.start(); t.join()\n", imports="import io, threading, time\n")
    recs = steps(rx, 4)
    checkpoint, evaluation, data = ([r.phase_seconds[PHASE_INDEX[name]] for r in recs]
                                    for name in ("checkpoint", "eval", "data"))
    assert checkpoint[0] == 0 and 0.1 <= checkpoint[1] < 0.2 and 0.1 <= checkpoint[2] < 0.2, (
        checkpoint)
    assert evaluation[2] >= 0.2 and data[2] < 0.1, (evaluation, data)
    assert checkpoint[3] == 0 and data[3] >= 0.4, data  # the other thread's save: data
    assert recs[-1].totals.checkpoints == 2  # the nested save is its outer one's: not 3


def test_zero_code_times_safetensors_saves_as_checkpoint(rx, tmp_path):
    """Hugging Face saves with safetensors' ``save_file`` and ``save_model`` (which calls
    ``save_file``: one save), imported the way it does (``from safetensors.torch import ...``,
    after ``install()``). Each is ``checkpoint`` in the step it falls in; unpatched, a 32 MB save
    read as ``data`` (checkpoint 0)."""
    pytest.importorskip("safetensors")
    spans = tmp_path / "spans.json"
    run_zero_code(rx, "from safetensors.torch import save_file, save_model\n"
                      "model = DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "big = torch.nn.Linear(2048, 4096, bias=False)\n"
                      "spans = []\n"
                      "for i in range(4):\n"
                      "    model(torch.randn(5, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
                      "    if i in (0, 1):\n"
                      "        t0 = time.monotonic()\n"
                      f"        path = {str(tmp_path)!r} + f'/{{i}}.safetensors'\n"
                      "        save_file(big.state_dict(), path) if i == 0 else save_model(big, path)\n"
                      "        spans.append(time.monotonic() - t0)\n"
                      f"open({str(spans)!r}, 'w').write(json.dumps(spans))\n",
                  imports="import json, time\n")
    recs = steps(rx, 4)
    saved = json.loads(spans.read_text())
    for rec, span in zip(recs[1:3], saved):  # a save after step n's optimizer is step n + 1's
        assert 0.5 * span <= phase(rec, "checkpoint") <= span, (rec.phase_seconds, span)
        assert phase(rec, "data") < 0.5 * span, (rec.phase_seconds, span)
    assert phase(recs[3], "checkpoint") == 0
    assert recs[-1].totals.checkpoints == 2


def test_register_handle_remove_restores_torch_distributed():
    dist = pytest.importorskip("torch.distributed")
    import syncwatch.instrument as sw
    from syncwatch.instrument.hooks import COLLECTIVES
    before = {name: getattr(dist, name) for name in COLLECTIVES}
    wait = dist.Work.wait
    handle = sw.register(collectives=True)
    try:
        for name, fn in before.items():
            assert getattr(dist, name) is not fn and getattr(dist, name)._syncwatch_original is fn
        assert dist.Work.wait._syncwatch_original is wait
        again = sw.register(collectives=True)  # idempotent: no wrapper around a wrapper
        assert all(getattr(dist, n)._syncwatch_original is before[n] for n in before)
        assert dist.Work.wait._syncwatch_original is wait
        again.remove()
    finally:
        handle.remove()
    assert {name: getattr(dist, name) for name in COLLECTIVES} == before
    assert dist.Work.wait is wait


def test_every_wrapped_collective_is_counted_and_its_wait_timed(rx, ddp_world1):
    """Each collective of torch 2.13 that syncwatch wraps (FSDP's ``*_single`` included), on a
    real gloo group: a blocking call notes a timed collective, ``async_op=True`` given by
    position (where the signature puts it) bumps the sequence, and the wait on its work is
    timed (once: a second wait is not; it was not timed at all)."""
    torch = ddp_world1
    dist = torch.distributed
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    from syncwatch.instrument.hooks import COLLECTIVES
    from syncwatch.instrument.monitor import COLL, COLL_END, SEQ, WAITED

    def t():
        return torch.arange(4.0)
    args = {  # the positional arguments before async_op
        "all_reduce": lambda: (t(), dist.ReduceOp.SUM, None),
        "reduce_scatter": lambda: (t(), [t()], dist.ReduceOp.SUM, None),
        "reduce_scatter_tensor": lambda: (t(), t(), dist.ReduceOp.SUM, None),
        "reduce_scatter_single": lambda: (t(), t(), dist.ReduceOp.SUM, None),
        "all_gather": lambda: ([t()], t(), None),
        "all_gather_into_tensor": lambda: (t(), t(), None),
        "all_gather_single": lambda: (t(), t(), None),
        "all_to_all": lambda: ([t()], [t()], None),
        "all_to_all_single": lambda: (t(), t(), None, None, None),
        "broadcast": lambda: (t(), 0, None),
        "reduce": lambda: (t(), 0, dist.ReduceOp.SUM, None),
        "gather": lambda: (t(), [t()], 0, None),
        "scatter": lambda: (t(), [t()], 0, None),
        "barrier": lambda: (None,),
    }
    assert set(args) == set(COLLECTIVES)
    m = make_monitor(rx, flush_seconds=3600)  # the entries stay where the test reads them
    _state.set_monitor(m)
    handle = sw.register(collectives=True)
    try:
        for name, make in args.items():
            m._entries.clear()
            fn = getattr(dist, name)
            assert fn._syncwatch_original is not fn
            assert fn(*make()) is None, name
            work = fn(*make(), True)
            work.wait()
            work.wait()
            assert [e[0] for e in m._entries] == [COLL, COLL_END, SEQ, WAITED, COLL_END], name
        x = t()
        dist.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        handle.remove()
        _state.set_monitor(None)
        m.shutdown()


def test_ddp_hook_wrapper_times_buckets_and_passes_through_when_detached(rx):
    torch = pytest.importorskip("torch")
    from syncwatch.instrument import _state
    from syncwatch.instrument.hooks import ddp_hook_wrapper

    def user_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket * state)
        return fut
    enabled = [True]
    hook = ddp_hook_wrapper(user_hook, enabled)
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        out = hook(2.0, torch.ones(3)).wait()
        assert torch.equal(out, torch.full((3,), 2.0))          # the user's hook's result
        m.flush()
        assert m.collective_sequence == 1 and m._done is not None
        enabled[0] = False                                      # handle.remove()
        assert torch.equal(hook(3.0, torch.ones(3)).wait(), torch.full((3,), 3.0))
        m.flush()
        assert m.collective_sequence == 1
    finally:
        _state.set_monitor(None)
        m.shutdown()


# --------------------------------------------------------------------------- DDP, one gloo rank

@pytest.fixture
def ddp_world1():
    """A real one-rank gloo process group in this process (DDP needs one)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield torch
    dist.destroy_process_group()


def make_ddp(torch, frozen_first=False):
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])  # 12 parameters
    if frozen_first:
        model[0].weight.requires_grad_(False)
    return torch.nn.parallel.DistributedDataParallel(model)


def train_step(m, ddp, torch, x):
    with m.phase("forward"):
        loss = ddp(x).sum()
    with m.phase("backward"):
        loss.backward()
    m.step(1)


def late_allreduce_hook(state, bucket):
    """A comm hook whose collective completes 50 ms after it is launched."""
    import threading
    import torch
    fut = torch.futures.Future()
    threading.Timer(0.05, fut.set_result, (bucket.buffer(),)).start()
    return fut


@pytest.mark.parametrize("how", ["no argument", "None", "WORLD"])
def test_destroying_the_default_group_shuts_the_monitor_down_first(rx, sock_path, how):
    """``destroy_process_group()``, ``(None)`` and ``(group.WORLD)`` all destroy every group, the
    skew exchange's side group too: the monitor shuts down before (end record sent), and a
    later ``init()`` starts a new one instead of returning the old one with a dead exchange."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = sw.init(job="destroy", socket=sock_path, heartbeat_seconds=0)
        assert m is not None
        m.step(1)
    finally:
        args = {"no argument": (), "None": (None,), "WORLD": (dist.group.WORLD,)}[how]
        dist.destroy_process_group(*args)
    assert sw.current() is None and m.closed
    assert wait_for(lambda: rx.of(EndRecord))


def test_a_second_init_in_one_process_is_a_new_process_to_the_daemon(rx, sock_path):
    """``init()`` after a shutdown (a retry or a second run in the same process) starts counting
    from 0 again with the same pid and attempt. Its identity's nonce is drawn anew, so the daemon
    takes it as a new process: fresh counters, and a restart whose re-run steps are the first
    run's 1..3 (the daemon's definition: previous highest step − first step + 1). With one nonce
    the second run's steps were duplicates of the first's, ignored (3 steps, no restart)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    from syncwatch.daemon.config import DaemonConfig
    from syncwatch.daemon.state import State
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        idents = []
        for steps in (3, 2):
            m = sw.init(job="again", socket=sock_path, heartbeat_seconds=0, exchange_every=0)
            idents.append(m.identity)
            for _ in range(steps):
                m.step(1)
            sw.shutdown()
    finally:
        dist.destroy_process_group()
    assert wait_for(lambda: len(rx.of(EndRecord)) == 2)
    assert idents[0].pid == idents[1].pid and idents[0].attempt == idents[1].attempt
    assert idents[0].nonce != idents[1].nonce
    state = State(DaemonConfig(socket=None))
    for record in rx.records:
        state.apply(record)
    job = state.snapshot().jobs[0]
    assert (job.ranks[0].totals.steps, job.ranks[0].last_step) == (2, 2)
    assert (job.restarts, job.rerun_steps) == (1, 3)


def test_a_second_init_while_running_says_it_is_ignored_without_blaming_syncwatch_run(
        rx, sock_path, caplog):
    """The script's own ``init()`` called twice (a helper that calls it again): the monitor goes
    on as the first one started it, and the warning says so. It said that syncwatch-run had
    started the instrumentation at the first model, in a script never run under syncwatch-run."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = sw.init(job="first", socket=sock_path, heartbeat_seconds=0, exchange_every=0)
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            again = sw.init(job="second", heartbeat_seconds=1)
        sw.step(1)
        sw.shutdown()
    finally:
        dist.destroy_process_group()
    assert again is first
    (warning,) = [r.getMessage() for r in caplog.records if "init()" in r.getMessage()]
    assert "init() called again" in warning and "ignores job, heartbeat_seconds;" in warning
    assert "syncwatch-run" not in warning and "shutdown() first" in warning
    (rec,) = steps(rx, 1)
    assert rec.identity.train_job == "first"


@pytest.mark.parametrize("var, value", [
    ("SYNCWATCH_HEARTBEAT", "-1"), ("SYNCWATCH_HEARTBEAT", "nan"), ("SYNCWATCH_HEARTBEAT", "0"),
    ("SYNCWATCH_HEARTBEAT", "inf"), ("SYNCWATCH_HEARTBEAT", "x"), ("SYNCWATCH_SKEW_EVERY", "-3"),
    ("SYNCWATCH_SKEW_SECONDS", "-5"), ("SYNCWATCH_SKEW_SECONDS", "nan"),
    ("SYNCWATCH_DEVICE", "gpu"), ("SYNCWATCH_DEVICE", "cuda")])
def test_a_bad_environment_value_is_said_once_and_its_default_taken(
        rx, sock_path, caplog, monkeypatch, monitor_args, var, value):
    """What ``syncwatch-run`` refuses before the command runs, set in the environment of a script
    using the API: a heartbeat of -1, ``nan`` or 0 sent none (``inf`` none after the first) (the
    daemon then has no phase or liveness of the rank), a negative K turned the exchange off, a
    negative window time was taken as it came and a device that is neither cpu nor cuda read as
    cpu, all without a word; ``cuda`` where CUDA is not available raised, and the rank trained
    unmonitored. Each now gives one warning naming the variable, and its default."""
    torch = pytest.importorskip("torch")
    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("cuda is a good value here")
    dist = torch.distributed
    import syncwatch.instrument as sw
    monkeypatch.setenv(var, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            m = sw.init(job="env", socket=sock_path)
        assert m is not None
        assert wait_for(lambda: rx.of(HeartbeatRecord))  # heartbeats on, every 5 s
        assert (m.exchange_seconds, m.clock.lazy) == (30.0, False)
        # the defaults taken, not only said: a K of -3 or a heartbeat of inf taken after the
        # warning passed (world size 1: no exchange, and inf still sends the first heartbeat)
        assert {k: monitor_args[0][k] for k in DEFAULT_SETTINGS} == DEFAULT_SETTINGS
    finally:
        sw.shutdown()
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and f"ignoring {var}={value!r}" in said[0], said


def test_a_socket_argument_wins_over_an_inherited_syncwatch_udp(rx, sock_path, monkeypatch):
    """``init(socket=...)`` where ``SYNCWATCH_UDP`` is set (a cluster-wide default): the
    argument is given, so the variable is not consulted, as ``syncwatch-run --socket`` does it.
    The sender took the variable first, and every record went over UDP, none to the socket."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    monkeypatch.setenv("SYNCWATCH_UDP", "127.0.0.1:9")  # discard: nobody listens
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = sw.init(job="mine", socket=sock_path, heartbeat_seconds=0)
        assert m is not None and m.sender.address == sock_path
        m.step(samples=2)
        assert steps(rx, 1)[0].samples == 2
    finally:
        sw.shutdown()
        dist.destroy_process_group()


@pytest.mark.parametrize("arg, value", [
    ("heartbeat_seconds", -1), ("heartbeat_seconds", float("nan")),
    ("heartbeat_seconds", float("inf")), ("heartbeat_seconds", "5"),
    ("heartbeat_seconds", True), ("exchange_every", -3), ("exchange_every", 2.5),
    ("exchange_every", "10"), ("exchange_seconds", -5), ("exchange_seconds", float("nan"))])
def test_a_bad_numeric_argument_is_said_once_and_its_default_taken(
        rx, sock_path, caplog, monkeypatch, monitor_args, arg, value):
    """``init(heartbeat_seconds=-1)`` or ``nan`` sent no heartbeat, ``exchange_every=-3``
    turned the exchange off and ``exchange_seconds=-5`` was taken as 0, all without a word,
    where the ``SYNCWATCH_*`` variables with the same values warned; ``heartbeat_seconds="5"``
    stopped the records thread (a TypeError there): no record sent at all. Each now gives one
    warning naming the argument, and its default (the variable not consulted in its place)."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    monkeypatch.setenv("SYNCWATCH_HEARTBEAT", "0.01")  # not consulted for a bad argument
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            m = sw.init(job="arg", socket=sock_path, **{arg: value})
        assert m is not None
        assert wait_for(lambda: rx.of(HeartbeatRecord))  # heartbeats on
        m.step(samples=2)
        assert steps(rx, 1)
        assert m.exchange_seconds == 30.0
        # the default taken, not only said (see the environment's test); the others as set
        heartbeat = 5.0 if arg == "heartbeat_seconds" else 0.01
        taken = {**DEFAULT_SETTINGS, "heartbeat_seconds": heartbeat}
        assert {k: monitor_args[0][k] for k in DEFAULT_SETTINGS} == taken
        if arg == "heartbeat_seconds":
            time.sleep(0.3)  # every 5 s, not the variable's 0.01
            assert len(rx.of(HeartbeatRecord)) == 1
    finally:
        sw.shutdown()
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and f"ignoring {arg}={value!r}" in said[0], said
    default = {"heartbeat_seconds": "5", "exchange_every": "50", "exchange_seconds": "30"}[arg]
    assert said[0].endswith(f"using {default}"), said


@pytest.mark.parametrize("value, attempt, said", [
    (MAX_ATTEMPT, MAX_ATTEMPT - 1, False), (3, 3, False), (-1, 2, True), ("3", 2, True),
    (True, 2, True), (2.0, 2, True)])
def test_an_attempt_argument_beyond_the_protocols_bound_or_no_attempt_still_starts(
        rx, sock_path, caplog, monkeypatch, value, attempt, said):
    """``init(attempt=2**20)``, beyond the protocol's bound, or ``attempt=-1`` or ``"3"``: the
    identity failed to encode, and the rank ran with no instrumentation at all (found with a
    real rank; the same number from ``SYNCWATCH_ATTEMPT`` stays at 2**20 - 1); ``True`` was
    attempt 1. The bound's number stays at its last value; what is no attempt number is said
    once, naming the argument, and the launchers' attempt is taken."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            m = sw.init(job="arg", socket=sock_path, attempt=value, heartbeat_seconds=0)
        assert m is not None and m.identity.attempt == attempt
        m.step(samples=2)
        assert steps(rx, 1)[0].identity.attempt == attempt
    finally:
        sw.shutdown()
        dist.destroy_process_group()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == ([f"syncwatch: ignoring attempt={value!r} (expected a whole number from "
                       f"0): using 2"] if said else []), warned


def test_zero_heartbeat_and_exchange_arguments_turn_them_off_without_a_warning(
        rx, sock_path, caplog):
    """``heartbeat_seconds=0`` and ``exchange_every=0`` are the documented "off"; ``inf``
    window time keeps windows of K, as ``SYNCWATCH_SKEW_SECONDS=inf`` does."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            m = sw.init(job="off", socket=sock_path, heartbeat_seconds=0, exchange_every=0,
                        exchange_seconds=float("inf"))
        m.step(samples=2)
        assert steps(rx, 1) and m.exchange_seconds == float("inf")
    finally:
        sw.shutdown()
        dist.destroy_process_group()
    assert not rx.of(HeartbeatRecord)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("device", ["gpu", "CUDA", ""])
def test_a_bad_device_argument_is_said_once_and_the_default_taken(
        rx, sock_path, caplog, monkeypatch, device):
    """``init(device='gpu')`` read as cpu without a word, where ``SYNCWATCH_DEVICE=gpu`` warned:
    the argument now gets the variable's treatment, one warning naming it, and the default (the
    CPU clock on a gloo group), the variable not consulted in its place."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    import syncwatch.instrument as sw
    monkeypatch.delenv("SYNCWATCH_DEVICE", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="syncwatch.instrument"):
            m = sw.init(job="dev", socket=sock_path, device=device)
        assert m is not None and isinstance(m.clock, HostClock)
        m.step(samples=4)
        assert steps(rx, 1)[-1].identity.gpu == -1
    finally:
        sw.shutdown()
        dist.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [f"syncwatch: ignoring device={device!r} (expected cpu or cuda)"], said


def test_default_ddp_path_registers_no_comm_hook_and_waits_for_the_collectives(rx, ddp_world1):
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        ddp = make_ddp(torch, frozen_first=True)
        sw.register(ddp, collectives=False)
        assert ddp._comm_hooks == [] and ddp._get_ddp_logging_data().get("comm_hook") is None
        params = list(ddp.parameters())
        hooked = [bool(p._post_accumulate_grad_hooks) for p in params]
        assert hooked == [False, True] + [False] * 10  # the first that requires grad: all get one
        x = torch.randn(4, 8)
        train_step(m, ddp, torch, x)
        with ddp.no_sync():                    # gradient accumulation: nothing is synchronized
            train_step(m, ddp, torch, x)
        sw.register(ddp, collectives=False)    # already watched: not measured twice
        # the script's own comm hook, whose all-reduce ends 50 ms after the gradients are ready:
        # the wait ends when DDP has waited for it, not when backward's compute ended
        ddp.register_comm_hook(None, late_allreduce_hook)
        train_step(m, ddp, torch, x)
        r1, r2, r3 = steps(rx, 3)
        assert 0 < r1.wait_seconds < 0.05 and r1.collective_sequence == 1
        assert r1.wait_seconds == phase(r1, "sync")
        assert r2.wait_seconds == 0 and phase(r2, "sync") == 0 and r2.collective_sequence == 1
        # less what backward ran after the hook launched it (5-8 ms on a loaded machine)
        assert 0.04 <= r3.wait_seconds < 0.2 and r3.collective_sequence == 2
        assert phase(r3, "backward") < 0.05   # the wait is not backward compute
        assert r3.totals.internal_errors == 0
    finally:
        _state.set_monitor(None)
        m.shutdown()


@pytest.mark.parametrize("path", ["hook-free", "wrapper"])
def test_a_step_with_two_gradient_syncs_waits_their_sum(rx, ddp_world1, path):
    """Two DDP models in one step (a GAN's discriminator and generator), each all-reduce ending
    50 ms late: the step's wait is both waits, whether each backward has its phase or they share
    one; a second backward that DDP does not synchronize (a loss through the module, without
    DDP's forward) adds its ~0 where it used to replace the step's real wait. The same through
    ``ddp_hook_wrapper``, whose buckets carry their backward: with one shared phase it counted
    the second model's wait only."""
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        disc, gen = make_ddp(torch), make_ddp(torch)
        for model in (disc, gen):
            if path == "wrapper":
                sw.register(model, hook=late_allreduce_hook, collectives=False)
            else:
                sw.register(model, collectives=False)
                model.register_comm_hook(None, late_allreduce_hook)
        x = torch.randn(4, 8)
        with m.phase("backward"):
            disc(x).sum().backward()
        with m.phase("backward"):
            gen(x).sum().backward()
        m.step(4)
        with m.phase("backward"):
            disc(x).sum().backward()
            gen(x).sum().backward()
        m.step(4)
        with m.phase("backward"):
            disc(x).sum().backward()
            disc.module(x).sum().backward()  # not DDP's forward: nothing synchronized
        m.step(4)
        r1, r2, r3 = steps(rx, 3)
        # each delay runs from its hook's launch, the wait from the end of backward's compute:
        # less what compute remains after the launch (ms on a loaded machine: 0.096 s and 0.043 s
        # of one wait seen); one wait where two belong would be 0.05 s
        for r in (r1, r2):
            assert 0.08 <= r.wait_seconds < 0.3 and r.wait_seconds == phase(r, "sync")
            assert phase(r, "backward") < 0.05
        assert 0.04 <= r3.wait_seconds < 0.1
        # the hook-free path counts DDP's buckets for any backward through the parameters; the
        # wrapper counts the buckets DDP launched
        assert [r.collective_sequence for r in (r1, r2, r3)] == (
            [2, 4, 6] if path == "hook-free" else [2, 4, 5])
        assert r3.totals.internal_errors == 0
    finally:
        _state.set_monitor(None)
        m.shutdown()


@pytest.mark.parametrize("path", ["hook-free", "wrapper"])
def test_a_synchronized_backward_advances_the_sequence_by_ddps_buckets(rx, ddp_world1, path):
    """A DDP model of several buckets launches one all-reduce per bucket, and a synchronized
    backward advances the collective sequence by as many. The models of the other DDP tests have
    one bucket: a sequence advanced by 1 a backward passed them. DDP launches one bucket in its
    first backward and rebuilds them (here: 3 buckets of 576 bytes) in the second's forward; the
    hook-free path reads the count from DDP's logging data, which shows the rebuilt buckets one
    backward late (the wrapper counts the buckets' hook calls): compared from the third on."""
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    from torch import nn
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]), bucket_cap_mb=0.0005)
        if path == "wrapper":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            sw.register(ddp, hook=allreduce_hook, state=None, collectives=False)
        else:
            sw.register(ddp, collectives=False)
        x = torch.randn(4, 8)
        for _ in range(5):
            train_step(m, ddp, torch, x)
        assert ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") == "576, 576, 576"
        recs = steps(rx, 5)
        seq = [r.collective_sequence for r in recs]
        assert seq[0] == 1 and [b - a for a, b in zip(seq[1:], seq[2:])] == [3, 3, 3], seq
        assert recs[-1].totals.internal_errors == 0
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_with_unused_parameters_allowed_the_first_and_last_4_are_watched(rx, ddp_world1):
    """With ``find_unused_parameters`` the first parameter may get no gradient: the wait is
    still measured through another watched one."""
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    from torch import nn

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.skipped = nn.Linear(8, 8)
            self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])

        def forward(self, x, skip):
            return self.layers(x if skip else self.skipped(x))

    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
        sw.register(ddp, collectives=False)
        assert [bool(p._post_accumulate_grad_hooks) for p in ddp.parameters()] == (
            [True] * 4 + [False] * 4 + [True] * 4)
        x = torch.randn(4, 8)
        for skip in (False, True):
            with m.phase("backward"):
                ddp(x, skip).sum().backward()
            m.step(4)
        r1, r2 = steps(rx, 2)
        assert r1.wait_seconds > 0 and r1.collective_sequence == 1
        assert r2.wait_seconds > 0 and r2.collective_sequence == 2  # self.skipped got no gradient
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_a_backbone_frozen_after_wrapping_still_has_its_wait_measured(rx, ddp_world1):
    """Fine-tuning that freezes the backbone for its first steps (or a linear probe) after
    wrapping, with ``find_unused_parameters``: the watched parameters were the first 8, the
    backbone's, which got no gradient, and every such step recorded no wait: the wait read as
    ``backward`` and the exchange saw no slack. The last parameters (the head) are watched too."""
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])  # 12 parameters
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        sw.register(ddp, collectives=False)
        ddp.register_comm_hook(None, late_allreduce_hook)  # the all-reduce ends 50 ms late
        x = torch.randn(4, 8)
        for frozen in (True, False):
            for p in model[:5].parameters():  # all but the head
                p.requires_grad_(not frozen)
            train_step(m, ddp, torch, x)
        r1, r2 = steps(rx, 2)
        for r in (r1, r2):
            assert 0.04 <= r.wait_seconds < 0.2 and r.wait_seconds == phase(r, "sync")
            assert r.collective_sequence >= 1
        assert r2.totals.internal_errors == 0
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_removed_handle_detaches_the_gradient_hooks(rx, ddp_world1):
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        ddp = make_ddp(torch)
        handle = sw.register(ddp, collectives=False)
        x = torch.randn(4, 8)
        train_step(m, ddp, torch, x)
        handle.remove()
        assert not any(p._post_accumulate_grad_hooks for p in ddp.parameters())
        train_step(m, ddp, torch, x)
        r1, r2 = steps(rx, 2)
        assert r1.wait_seconds > 0 and r1.collective_sequence == 1
        assert r2.wait_seconds == 0 and phase(r2, "sync") == 0 and r2.collective_sequence == 1
        again = sw.register(ddp, collectives=False)  # a removed watch can be registered again
        train_step(m, ddp, torch, x)
        assert steps(rx, 3)[2].collective_sequence == 2
        again.remove()
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_a_watched_model_outliving_its_monitor_does_not_keep_it(rx, ddp_world1):
    """The hook's first callback (a relay bound to the monitor) is the monitor's to keep: a model
    kept after ``shutdown()`` (evaluated, saved) must not hold the shut-down monitor, its
    queues and sender, for as long as it lives; a new monitor measures the same hooks."""
    import gc
    import weakref

    from syncwatch.instrument import _state
    from syncwatch.instrument.hooks import BUCKET_COUNT_READS, watch_gradients
    torch = ddp_world1
    ddp, x = make_ddp(torch), torch.randn(4, 8)
    watch_gradients(ddp)
    m = make_monitor(rx)
    _state.set_monitor(m)
    for _ in range(BUCKET_COUNT_READS + 2):  # past the bucket-count reads: the relay's steps
        train_step(m, ddp, torch, x)
    assert len(m.relays) == 1
    _state.set_monitor(None)
    m.shutdown()
    gone = weakref.ref(m)
    del m
    gc.collect()
    assert gone() is None
    m2 = make_monitor(rx)
    _state.set_monitor(m2)
    try:
        train_step(m2, ddp, torch, x)
        last = steps(rx, BUCKET_COUNT_READS + 3)[-1]
        assert last.totals.steps == 1 and last.wait_seconds > 0  # the new monitor's first step
    finally:
        _state.set_monitor(None)
        m2.shutdown()


@pytest.mark.parametrize("unused", [False, True], ids=["one-watched", "unused-allowed"])
def test_a_watched_model_the_script_lets_go_of_is_freed(rx, ddp_world1, unused):
    """torch keeps a parameter's post-accumulate-grad hooks where the garbage collector cannot
    see them: a hook holding its model made a cycle never collected, and every DDP model the
    process watched stayed in memory with its parameters and gradients (zero-code mode watches
    each one built: a sweep, a cross-validation, a retry in the same process ran out of memory)."""
    import gc
    import weakref

    from syncwatch.instrument import _state
    from syncwatch.instrument.hooks import BUCKET_COUNT_READS, watch_gradients
    from torch import nn
    torch = ddp_world1
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), find_unused_parameters=unused)
        watch_gradients(ddp)  # the handle dropped, as zero-code mode does
        for _ in range(BUCKET_COUNT_READS + 1):  # the bucket-count reads and the relay's steps
            train_step(m, ddp, torch, torch.randn(4, 8))
        assert steps(rx, BUCKET_COUNT_READS + 1)[-1].wait_seconds > 0
        model, inner = weakref.ref(ddp), ddp.module
        del ddp
        gc.collect()
        assert model() is None
        inner(torch.randn(4, 8)).sum().backward()  # the module trained on alone: hooks still on
        weight = weakref.ref(inner[0].weight)
        del inner
        gc.collect()
        assert weight() is None and m.errors == 0
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_register_takes_an_fsdp_model_as_its_wrapped_collectives(rx, ddp_world1, caplog):
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    m = make_monitor(rx)
    _state.set_monitor(m)
    models = [fully_shard(torch.nn.Linear(4, 4)),
              FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))]
    try:
        for model in models:
            handle = sw.register(model)
            assert torch.distributed.all_gather_single._syncwatch_original
            assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
            handle.remove()
            assert not hasattr(torch.distributed.all_gather_single, "_syncwatch_original")
        assert m.errors == 0 and not caplog.text
        sw.register(models[0], collectives=False)
        assert m.errors == 0 and "none of them is measured" in caplog.text
        sw.register(models[1], hook=lambda state, bucket: None).remove()  # a DDP comm hook:
        assert m.errors == 1 and "not FSDP's" in caplog.text                # refused
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_register_refuses_a_model_that_is_not_ddp(rx, caplog):
    torch = pytest.importorskip("torch")
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        model = torch.nn.Linear(2, 2)
        sw.register(model, collectives=False)
        assert not model.weight._post_accumulate_grad_hooks
        assert m.errors == 1 and "could not register" in caplog.text
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_register_tells_a_refused_model_in_one_line(rx, caplog):
    """Registering the module inside DDP, a common slip, was told twice per rank, each time
    with a traceback through syncwatch's own code: "could not register ..." and then the
    monitor's "internal error (counted, training continues)", which reads as a syncwatch bug."""
    torch = pytest.importorskip("torch")
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        sw.register(torch.nn.Linear(2, 2), collectives=False)
        assert m.errors == 1 and len(caplog.records) == 1
        assert caplog.records[0].getMessage() == (
            "syncwatch: could not register the model's gradient wait: neither a "
            "DistributedDataParallel nor an FSDP model: Linear")
        assert caplog.records[0].exc_info is None
    finally:
        _state.set_monitor(None)
        m.shutdown()


def test_register_watches_the_ddp_model_inside_torch_compile(rx, ddp_world1, caplog):
    """``torch.compile(DDP(model))``, the order torch recommends, is an ``OptimizedModule``: it
    was refused as "not DDP", so the job had no gradient wait, and, the error raised before the
    collectives were wrapped, none of those either."""
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    handle = None
    try:
        ddp = make_ddp(torch)
        net = torch.compile(ddp, backend="aot_eager")
        handle = sw.register(net)
        assert ddp.module[0].weight._post_accumulate_grad_hooks
        assert torch.distributed.all_reduce._syncwatch_original
        x = torch.randn(4, 8)
        for _ in range(2):
            train_step(m, net, torch, x)
        r1, r2 = steps(rx, 2)
        assert r2.wait_seconds > 0 and r2.wait_seconds == phase(r2, "sync")
        assert r2.collective_sequence == 2 and m.errors == 0 and "syncwatch" not in caplog.text
    finally:
        if handle is not None:
            handle.remove()
        _state.set_monitor(None)
        m.shutdown()


def test_register_wraps_the_collectives_even_where_the_model_is_refused(rx, ddp_world1, caplog):
    torch = ddp_world1
    import syncwatch.instrument as sw
    from syncwatch.instrument import _state
    m = make_monitor(rx)
    _state.set_monitor(m)
    try:
        handle = sw.register(torch.nn.Linear(2, 2))
        assert m.errors == 1 and "could not register the model's gradient wait" in caplog.text
        assert torch.distributed.all_reduce._syncwatch_original
        handle.remove()
        assert not hasattr(torch.distributed.all_reduce, "_syncwatch_original")
    finally:
        _state.set_monitor(None)
        m.shutdown()
