"""The collector runner: timing, success, no-data vs error, rate-limited logs, a hanging collector
(one worker, skipped cycles, last snapshot then withdrawal), and the flags derived from the table."""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading
import time
from collections import Counter

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

from collector_helpers import registry_of
from syncwatch import collectors
from syncwatch.collectors import CollectorRunner, NoData
from syncwatch.collectors.base import RateLimitedLog
from syncwatch.collectors.fake_nvml import FakeNvml
from syncwatch.collectors.gpu import GpuCollector


class Const:
    def __init__(self, device="a", value=1.0):
        self.device, self.value = device, value

    def update(self, errors):
        g = GaugeMetricFamily("syncwatch_test_value", "test", labels=["device"])
        g.add_metric([self.device], self.value)
        return [g]


class Broken:
    def update(self, errors):
        raise OSError("boom")


class Absent:
    def update(self, errors):
        raise NoData("nothing here")


class Partial(Const):
    def update(self, errors):
        errors.append("/sys/x: Permission denied")
        return super().update(errors)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Taking:
    """``inner`` whose update takes ``seconds`` of ``clock``."""

    def __init__(self, inner, clock: Clock, seconds: float):
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def update(self, errors):
        self.clock.t += self.seconds
        return self.inner.update(errors)


def value(runner, metric, **labels):
    return registry_of(runner.collect()).get_sample_value(metric, labels)


def test_success_duration_and_isolation():
    clock = Clock()
    took = {"const": 0.25, "broken": 0.5, "absent": 0.125, "partial": 1.0}
    inner = {"const": Const(), "broken": Broken(), "absent": Absent(), "partial": Partial("b", 2)}
    runner = CollectorRunner({name: Taking(c, clock, took[name]) for name, c in inner.items()}, clock=clock)
    runner.run_once()
    ok = "syncwatch_collector_success"
    assert value(runner, ok, collector="const") == 1
    assert value(runner, ok, collector="broken") == 0
    assert value(runner, ok, collector="absent") == 1  # quiet no-data
    assert value(runner, ok, collector="partial") == 0  # data served, problem reported
    assert value(runner, "syncwatch_test_value", device="a") == 1
    assert value(runner, "syncwatch_test_value", device="b") == 2
    for name, seconds in took.items():  # each its own update's time, failed or not
        assert value(runner, "syncwatch_collector_duration_seconds", collector=name) == seconds


def test_a_cycle_over_its_timeout_is_a_failure_though_it_returned_data(caplog):
    """An update that returns, clean, after its timeout: its data is served, and the cycle reads
    failed (success 0, one error logged); the next one in time reads 1 again. The hanging test
    only looks while the call is stuck, and no other collector here overran: a runner that took
    a late cycle for a clean one passed them."""
    clock = Clock()
    slow = Taking(Const(), clock, 2.5)
    runner = CollectorRunner({"slow": slow}, timeout=2.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="syncwatch.collectors"):
        runner.run_once()
    assert value(runner, "syncwatch_collector_success", collector="slow") == 0
    assert value(runner, "syncwatch_collector_duration_seconds", collector="slow") == 2.5
    assert value(runner, "syncwatch_test_value", device="a") == 1
    assert [r.getMessage() for r in caplog.records] == [
        "collector slow: update took 2.500s, over the 2s timeout"]
    slow.seconds = 1.0
    runner.run_once()
    assert value(runner, "syncwatch_collector_success", collector="slow") == 1


def test_errors_are_logged_rate_limited(caplog):
    clock = [0.0]
    runner = CollectorRunner({"broken": Broken()}, clock=lambda: clock[0])
    with caplog.at_level(logging.ERROR, logger="syncwatch.collectors"):
        for _ in range(10):
            runner.run_once()
            clock[0] += 5
        assert len(caplog.records) == 1
        clock[0] += 60
        runner.run_once()
    assert len(caplog.records) == 2
    assert "suppressed" in caplog.records[1].getMessage()


def test_no_data_is_not_logged_as_error(caplog):
    runner = CollectorRunner({"absent": Absent()})
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        for _ in range(3):
            runner.run_once()
    assert caplog.records == []


class Vanishing(Const):
    """Data while its source is ``present``, ``NoData`` once it is not."""

    present = True

    def update(self, errors):
        if not self.present:
            raise NoData("gone")
        return super().update(errors)


def test_no_data_after_data_withdraws_the_last_snapshot_at_once(caplog):
    """A source gone after cycles with data (an InfiniBand device unbound, its sysfs tree gone):
    ``NoData`` says it is absent now, so the collector serves nothing from that cycle on and
    reads success 1, quietly, as a source never there does. Its last snapshot served until
    stale would show the gone hardware for 3 intervals + the timeout more. The tests above had
    only collectors that raised ``NoData`` from their first cycle: a runner that kept the last
    snapshot after ``NoData`` passed them."""
    clock = Clock()
    vanishing = Vanishing()
    runner = CollectorRunner({"v": vanishing}, clock=clock)
    runner.run_once()
    assert value(runner, "syncwatch_test_value", device="a") == 1
    vanishing.present = False
    clock.t += 5.0  # the next cycle, the snapshot far from stale (17 s)
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        runner.run_once()
    assert value(runner, "syncwatch_test_value", device="a") is None
    assert value(runner, "syncwatch_collector_success", collector="v") == 1
    assert caplog.records == []
    vanishing.present = True  # back: served again
    runner.run_once()
    assert value(runner, "syncwatch_test_value", device="a") == 1

def test_rate_limited_log_recovery_message(caplog):
    rl = RateLimitedLog("x", clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        rl.error("a")
        rl.ok()
        rl.ok()
    assert [r.getMessage() for r in caplog.records] == ["collector x: a", "collector x: recovered"]


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_hanging_nvml_call_never_delays_scrapes_nor_leaks():
    fake = FakeNvml()
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)}, interval=0.05, timeout=0.2, stale_after=2.0)
    registry = registry_of([])
    registry.register(runner)
    runner.start()
    try:
        ok = lambda: value(runner, "syncwatch_collector_success", collector="gpu")  # noqa: E731
        assert wait_for(lambda: ok() == 1)
        gate = fake.hang("nvmlDeviceGetPowerUsage")
        assert wait_for(lambda: ok() == 0)
        hung_at = time.monotonic()
        threads, fds, calls = Counter(t.name for t in threading.enumerate()), fd_count(), fake.calls
        worst = 0.0
        served_stale = withdrawn = False
        for _ in range(100):
            start = time.monotonic()
            text = generate_latest(registry).decode()
            worst = max(worst, time.monotonic() - start)
            has_gpu = "syncwatch_gpu_temperature_celsius" in text
            served_stale |= has_gpu and time.monotonic() - hung_at < 1.0
            withdrawn |= not has_gpu
            time.sleep(0.02)
        assert wait_for(lambda: value(runner, "syncwatch_gpu_up", gpu="0", uuid=fake.gpus[0].uuid) is None)
        assert worst < 2.0, f"a scrape took {worst:.3f}s"
        assert not Counter(t.name for t in threading.enumerate()) - threads
        assert fd_count() == fds
        assert fake.calls == calls, "the stuck worker was called again (or a new one started)"
        assert served_stale and withdrawn  # last snapshot first, withdrawn once stale
        assert ok() == 0
        assert value(runner, "syncwatch_collector_duration_seconds", collector="gpu") > 0.2
        gate.set()
        assert wait_for(lambda: ok() == 1)
        assert value(runner, "syncwatch_gpu_up", gpu="0", uuid=fake.gpus[0].uuid) == 1
    finally:
        fake.unhang()
        runner.stop()
    assert not any(t.name.startswith("syncwatch-collector-") for t in threading.enumerate())


def test_stop_abandons_a_stuck_worker_without_closing_under_it():
    fake = FakeNvml()
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)}, interval=0.05, timeout=0.1)
    gate = fake.hang("nvmlDeviceGetCount")
    runner.start()
    try:
        assert wait_for(lambda: value(runner, "syncwatch_collector_success", collector="gpu") == 0)
        start = time.monotonic()
        runner.stop(join_timeout=0.2)
        assert time.monotonic() - start < 1.0
        assert fake.initialized == 1  # not shut down while a call is inside NVML
    finally:
        gate.set()


def parse(argv, env=None, monkeypatch=None):
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    collectors.add_flags(p)
    return p.parse_args(argv)


def test_flags_and_env_twins_derive_from_the_table(monkeypatch):
    assert set(collectors.COLLECTORS) == {"gpu", "net", "infiniband"}
    args = parse([])
    assert collectors.enabled_names(args) == ["gpu", "infiniband", "net"]
    assert collectors.enabled_names(parse(["--no-collector.gpu"])) == ["infiniband", "net"]
    args = parse(["--collector.gpu"], env={"SYNCWATCH_COLLECTOR_GPU": "0"}, monkeypatch=monkeypatch)
    assert collectors.enabled_names(args) == ["gpu", "infiniband", "net"]  # the flag beats the env
    args = parse([], env={"SYNCWATCH_COLLECTOR_GPU": "off", "SYNCWATCH_PATH_SYSFS": "/host/sys",
                          "SYNCWATCH_COLLECTOR_INTERVAL": "2.5"}, monkeypatch=monkeypatch)
    assert collectors.enabled_names(args) == ["infiniband", "net"]
    assert (args.path_sysfs, args.collector_interval) == ("/host/sys", 2.5)
    runner = collectors.runner_from_args(args)
    assert runner.names == ["infiniband", "net"]
    none = parse(["--no-collector.gpu", "--no-collector.net", "--no-collector.infiniband"])
    assert collectors.runner_from_args(none) is None


def test_path_sysfs_routes_every_read(tmp_path):
    from collector_helpers import FIXTURES
    args = parse(["--no-collector.gpu", "--path.sysfs", str(FIXTURES / "sysfs" / "congested")])
    runner = collectors.runner_from_args(args)
    runner.run_once()
    assert value(runner, "syncwatch_roce_cnp_sent_total", device="mlx5_1", port="1") == 8_812_004
    assert value(runner, "syncwatch_nic_speed_bytes", device="ens1f0np0") == 25e9


def test_invalid_schedule_is_rejected():
    with pytest.raises(ValueError):
        CollectorRunner({}, interval=0)


@pytest.mark.parametrize("schedule", [dict(interval=math.nan), dict(interval=math.inf),
                                      dict(timeout=math.nan), dict(timeout=math.inf)])
def test_a_non_finite_schedule_is_rejected(schedule):
    # interval NaN passed "<= 0": the worker waited max(0, NaN - elapsed) = 0 s between cycles
    # (a core spinning) and its snapshots were never fresh enough (stale_after NaN) to be served;
    # interval inf raised OverflowError in Event.wait and ended the worker after one cycle
    with pytest.raises(ValueError):
        CollectorRunner({}, **schedule)
