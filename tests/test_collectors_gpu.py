"""GPU collector against the fake NVML (pynvml's names, types and NVMLError codes) and the real
pynvml of this machine (without a driver: NVML absent; with a GPU: read against nvidia-smi)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

import pynvml
import pytest

from collector_helpers import check_golden, promtool_check, registry_of, render
from syncwatch.collectors import CollectorRunner, NoData
from syncwatch.collectors.fake_nvml import FakeNvml, healthy_node
from syncwatch.collectors.gpu import THROTTLE_REASONS, GpuCollector

N = pynvml
UUID3 = healthy_node()[3].uuid


def labels(i: int, **extra) -> dict[str, str]:
    return {"gpu": str(i), "uuid": healthy_node()[i].uuid, **extra}


def key(i: int, **extra) -> tuple:
    """``labels`` as a hashable key for the case tables."""
    return tuple(labels(i, **extra).items())


def cycle(collector: GpuCollector):
    errors: list[str] = []
    families = [f for f in collector.update(errors) if f.samples]
    return registry_of(families), errors, families


def thermal(fake: FakeNvml) -> None:
    g = fake.gpus[5]
    g.temperature, g.sm_clock_mhz = 91, 1410
    g.reasons = N.nvmlClocksEventReasonSwThermalSlowdown | N.nvmlClocksEventReasonHwThermalSlowdown


def lost(code: int):
    def mutate(fake: FakeNvml) -> None:
        fake.gpus[3].error = code
    return mutate


def unsupported(fake: FakeNvml) -> None:
    for g in fake.gpus:
        g.memory_temperature = None  # per-field NOT_SUPPORTED inside nvmlDeviceGetFieldValues
        g.not_supported |= {"nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetTotalEccErrors"}


def no_permission_on_power(fake: FakeNvml) -> None:
    fake.gpus[1].error = None
    fake.gpus[1].not_supported.clear()
    original = fake.nvmlDeviceGetPowerUsage

    def power(handle):
        if fake._index(handle) == 1:
            raise N.NVMLError(N.NVML_ERROR_NO_PERMISSION)
        return original(handle)
    fake.nvmlDeviceGetPowerUsage = power


# name, mutation applied after a first healthy cycle, expected samples (None = absent), errors
CASES = [
    ("healthy", None, {
        ("syncwatch_gpu_up", key(0)): 1,
        ("syncwatch_gpu_temperature_celsius", key(7)): 47,
        ("syncwatch_gpu_memory_temperature_celsius", key(0)): 50,
        ("syncwatch_gpu_power_watts", key(2)): 302.0,
        ("syncwatch_gpu_energy_joules_total", key(1)): 1_001_000.0,
        ("syncwatch_gpu_sm_clock_hertz", key(0)): 1980e6,
        ("syncwatch_gpu_utilization_ratio", key(0)): 0.95,
        ("syncwatch_gpu_throttle_active", key(0, reason="thermal")): 0,
        ("syncwatch_gpu_ecc_errors_total", key(0, type="uncorrected")): 0,
        ("syncwatch_gpu_pcie_replays_total", key(0)): 0,
    }, 0),
    ("thermal_throttling", thermal, {
        ("syncwatch_gpu_throttle_active", key(5, reason="thermal")): 1,
        ("syncwatch_gpu_throttle_active", key(5, reason="sw_thermal")): 1,
        ("syncwatch_gpu_throttle_active", key(5, reason="hw_thermal")): 1,
        ("syncwatch_gpu_throttle_active", key(5, reason="power_cap")): 0,
        ("syncwatch_gpu_throttle_active", key(4, reason="thermal")): 0,
        ("syncwatch_gpu_sm_clock_hertz", key(5)): 1410e6,
        ("syncwatch_gpu_temperature_celsius", key(5)): 91,
    }, 0),
    ("gpu_lost_mid_run", lost(N.NVML_ERROR_GPU_IS_LOST), {
        ("syncwatch_gpu_up", key(3)): 0,  # keeps its uuid from the earlier cycle
        ("syncwatch_gpu_temperature_celsius", key(3)): None,  # withdrawn, not frozen
        ("syncwatch_gpu_power_watts", key(3)): None,
        ("syncwatch_gpu_up", key(4)): 1,
        ("syncwatch_gpu_temperature_celsius", key(4)): 44,
    }, 0),
    ("reset_required", lost(N.NVML_ERROR_RESET_REQUIRED), {
        ("syncwatch_gpu_up", key(3)): 0, ("syncwatch_gpu_energy_joules_total", key(3)): None,
        ("syncwatch_gpu_up", key(2)): 1}, 0),
    ("nvml_timeout", lost(N.NVML_ERROR_TIMEOUT), {
        ("syncwatch_gpu_up", key(3)): 0, ("syncwatch_gpu_sm_clock_hertz", key(3)): None}, 0),
    # the daemon may not open GPU 3 (its device file is not granted): a collector error, and no
    # syncwatch_gpu_up 0, which would page SyncwatchGpuLost for a healthy GPU
    ("no_permission_for_gpu", lost(N.NVML_ERROR_NO_PERMISSION), {
        ("syncwatch_gpu_up", key(3)): None, ("syncwatch_gpu_temperature_celsius", key(3)): None,
        ("syncwatch_gpu_up", key(4)): 1, ("syncwatch_gpu_temperature_celsius", key(4)): 44}, 1),
    ("not_supported", unsupported, {
        ("syncwatch_gpu_memory_temperature_celsius", key(0)): None,
        ("syncwatch_gpu_pcie_replays_total", key(0)): None,
        ("syncwatch_gpu_ecc_errors_total", key(0, type="corrected")): None,
        ("syncwatch_gpu_temperature_celsius", key(0)): 40,
        ("syncwatch_gpu_up", key(0)): 1}, 0),
    ("other_error_drops_one_metric", no_permission_on_power, {
        ("syncwatch_gpu_power_watts", key(1)): None,
        ("syncwatch_gpu_temperature_celsius", key(1)): 41,
        ("syncwatch_gpu_up", key(1)): 1}, 1),
]


@pytest.mark.parametrize("name,mutate,expected,n_errors", CASES, ids=[c[0] for c in CASES])
def test_gpu_cases(name, mutate, expected, n_errors):
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    _, errors, _ = cycle(collector)
    assert errors == []
    if mutate is not None:
        mutate(fake)
    reg, errors, families = cycle(collector)
    assert len(errors) == n_errors, errors
    for (metric, lbl), value in expected.items():
        assert reg.get_sample_value(metric, dict(lbl)) == value, (metric, lbl)
    text = render(families)
    check_golden(f"gpu_{name}", text)
    if name == "gpu_lost_mid_run":
        assert text.count(UUID3) == 1  # only the up series remains for the lost GPU


def test_thermal_reads_1_for_either_thermal_slowdown():
    """``thermal`` is sw_thermal or hw_thermal. The thermal_throttling case sets both bits: a
    ``thermal`` read from one of them alone (a GPU slowed by its hardware sensor read as not
    throttling thermally), or from both together, passed it."""
    fake = FakeNvml(healthy_node(4))
    fake.gpus[1].reasons = N.nvmlClocksEventReasonSwThermalSlowdown
    fake.gpus[2].reasons = N.nvmlClocksEventReasonHwThermalSlowdown
    fake.gpus[3].reasons = N.nvmlClocksEventReasonSwPowerCap | N.nvmlClocksEventReasonHwSlowdown
    reg = cycle(GpuCollector(nvml=fake))[0]

    def active(reason):
        return [reg.get_sample_value("syncwatch_gpu_throttle_active", labels(i, reason=reason))
                for i in range(4)]
    assert active("thermal") == [0, 1, 1, 0]
    assert active("sw_thermal") == [0, 1, 0, 0]
    assert active("hw_thermal") == [0, 0, 1, 0]


def test_lost_gpu_comes_back():
    fake = FakeNvml()
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    fake.gpus[3].error = N.NVML_ERROR_GPU_IS_LOST
    assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(3)) == 0
    fake.gpus[3].error = None
    reg = cycle(collector)[0]
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) == 1
    assert reg.get_sample_value("syncwatch_gpu_temperature_celsius", labels(3)) == 43


def test_a_gpu_down_is_warned_about_once_and_again_once_it_came_back_and_went(caplog):
    """A GPU lost, needing a reset or timing out reads ``syncwatch_gpu_up 0`` every cycle; the
    log says so once when it goes down, not every cycle it stays down (a warning every 5 s for
    a GPU lost overnight), and once more when it goes down again after it answered. The
    tests looked at the series only: a collector that warned every cycle, or never again,
    passed them."""
    fake = FakeNvml()
    collector = GpuCollector(nvml=fake)
    cycle(collector)

    def down_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if " is down: " in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        fake.gpus[3].error = N.NVML_ERROR_GPU_IS_LOST
        for _ in range(3):
            assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(3)) == 0
        assert down_warnings() == [f"gpu 3 ({UUID3}) is down: nvmlDeviceGetHandleByIndex: "
                                   "GPU is lost"]
        fake.gpus[3].error = None
        assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(3)) == 1
        caplog.clear()
        fake.gpus[3].error = N.NVML_ERROR_RESET_REQUIRED
        for _ in range(3):
            assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(3)) == 0
        assert down_warnings() == [f"gpu 3 ({UUID3}) is down: nvmlDeviceGetHandleByIndex: "
                                   "GPU requires restart"]

def test_xid_events_are_counted_per_gpu_and_xid():
    fake = FakeNvml()
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    fake.xid(3, 79)
    fake.xid(3, 79)
    fake.xid(0, 13)
    reg, _, families = cycle(collector)
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 2
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(0, xid="13")) == 1
    check_golden("gpu_xid_errors", render([f for f in families if f.name == "syncwatch_gpu_xid_errors"]))
    reg = cycle(collector)[0]  # counters persist, no double counting
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 2


def test_xid_events_export_when_the_latest_of_each_arrived():
    """NVML's event data carries no time: the alerts read when the daemon drained an XID (its
    count restarts with the daemon and appears only at the first XID, which increase() missed)."""
    wall = Clock()
    wall.t = 1_700_000_000.0
    fake = FakeNvml()
    collector = GpuCollector(nvml=fake, wall_clock=wall)
    stamp = "syncwatch_gpu_xid_last_event_timestamp_seconds"
    assert stamp not in render(cycle(collector)[2])  # no XID yet: no series
    fake.xid(3, 79)
    fake.xid(0, 13)
    reg, _, families = cycle(collector)
    assert reg.get_sample_value(stamp, labels(3, xid="79")) == 1_700_000_000.0
    assert reg.get_sample_value(stamp, labels(0, xid="13")) == 1_700_000_000.0
    promtool_check(render(families))
    wall.t += 120
    fake.xid(3, 79)
    reg = cycle(collector)[0]
    assert reg.get_sample_value(stamp, labels(3, xid="79")) == 1_700_000_120.0
    assert reg.get_sample_value(stamp, labels(0, xid="13")) == 1_700_000_000.0  # no new XID 13
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 2
    wall.t += 60
    reg = cycle(collector)[0]  # no event: the time stays that of the latest
    assert reg.get_sample_value(stamp, labels(3, xid="79")) == 1_700_000_120.0


def test_xids_of_the_other_gpus_are_read_while_one_is_lost(caplog):
    """While a GPU in the event set is lost, nvmlEventSetWait_v2 answers GPU_IS_LOST, without
    saying which GPU, and nothing more comes out of the set: every cycle failed (collector
    success 0) and no other GPU's XID was counted, just when XIDs matter. The set is made anew
    without the lost GPU; the XIDs already counted stay, and the GPU's own are read again once
    it answers."""
    fake = FakeNvml(healthy_node(8))
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)})
    runner.run_once()
    fake.xid(3, 48)
    runner.run_once()
    fake.gpus[3].error = N.NVML_ERROR_GPU_IS_LOST
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        runner.run_once()
    assert f"XIDs of gpu 3 ({UUID3}) are not read" in caplog.text
    xids = "syncwatch_gpu_xid_errors_total"
    for _ in range(3):
        fake.xid(0, 13)
        fake.xid(5, 31)
        runner.run_once()
        v = registry_of(runner.collect()).get_sample_value
        assert v("syncwatch_collector_success", {"collector": "gpu"}) == 1
        assert v("syncwatch_gpu_up", labels(3)) == 0
        assert v(xids, labels(3, xid="48")) == 1
    assert v(xids, labels(0, xid="13")) == 3
    assert v(xids, labels(5, xid="31")) == 3
    fake.gpus[3].error = None  # back (a reset): registered again
    runner.run_once()
    fake.xid(3, 94)
    runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v("syncwatch_collector_success", {"collector": "gpu"}) == 1
    assert v(xids, labels(3, xid="94")) == 1
    assert v(xids, labels(3, xid="48")) == 1


def test_gpus_renumbered_after_nvml_comes_back_keep_their_own_uuids():
    """GPU 3 falls off the bus and is gone when NVML is initialized again: the GPUs after it move
    down one index. Their values were exported under the UUIDs cached for the old indices, so GPU
    4's temperature read as the lost GPU 3's."""
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    fake.xid(3, 79)
    cycle(collector)
    fake.fall_off_bus(3)
    fake.initialized = 0  # the driver reloaded under us
    with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
        collector.update([])
    reg, errors, families = cycle(collector)
    assert errors == []
    old = healthy_node(8)
    for index, gpu in enumerate(old[:3] + old[4:]):
        assert reg.get_sample_value("syncwatch_gpu_temperature_celsius",
                                    {"gpu": str(index), "uuid": gpu.uuid}) == gpu.temperature
    # the lost GPU reads down under its own UUID and last index, with none of GPU 4's values
    assert [line for line in render(families).splitlines()
            if UUID3 in line and not line.startswith("syncwatch_gpu_xid_")] \
        == [f'syncwatch_gpu_up{{gpu="3",uuid="{UUID3}"}} 0.0']
    # the XID counted before, and its time, stay with the GPU it happened on
    for metric in ("syncwatch_gpu_xid_errors_total",
                   "syncwatch_gpu_xid_last_event_timestamp_seconds"):
        assert reg.get_sample_value(metric, labels(3, xid="79")) is not None
        assert reg.get_sample_value(metric, {"gpu": "3", "uuid": old[4].uuid, "xid": "79"}) is None
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 1


def reinit(collector: GpuCollector, fake: FakeNvml) -> None:
    """The driver reloads under the collector: nvmlDeviceGetCount fails, NVML is closed, and the
    next cycle initializes it again (and enumerates the GPUs anew)."""
    fake.initialized = 0
    with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
        collector.update([])


def test_xids_of_a_renumbered_gpu_move_to_its_new_index():
    """GPU 4 had XID 79; GPU 3 falls off the bus and NVML, initialized again, lists GPU 4 as
    index 3. Its XIDs were keyed by (index, uuid, xid): those counted before stayed under gpu="4"
    and a new one under gpu="3" started a second series, so SyncwatchGpuXidCritical fired twice for
    one GPU, and gpu="4" (now GPU 5's index) carried GPU 4's old XIDs on a dashboard summing by
    node and gpu. A remembered GPU read under a new index takes its XID counts and times along:
    one series per GPU and XID, under the index it has now."""
    wall = Clock()
    wall.t = 1_700_000_000.0
    old = healthy_node(8)
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake, wall_clock=wall)
    cycle(collector)
    fake.xid(4, 79)
    fake.xid(3, 48)
    cycle(collector)
    fake.fall_off_bus(3)
    reinit(collector, fake)
    wall.t += 60
    reg, errors, families = cycle(collector)
    assert errors == []
    xids, stamp = "syncwatch_gpu_xid_errors_total", "syncwatch_gpu_xid_last_event_timestamp_seconds"
    moved = {"gpu": "3", "uuid": old[4].uuid, "xid": "79"}
    assert reg.get_sample_value(xids, moved) == 1
    assert reg.get_sample_value(stamp, moved) == 1_700_000_000.0
    assert reg.get_sample_value(xids, {"gpu": "4", "uuid": old[4].uuid, "xid": "79"}) is None
    assert reg.get_sample_value(xids, labels(3, xid="48")) == 1  # the gone GPU's stay with it
    fake.xid(3, 79)  # GPU 4, index 3 now
    reg, _, families = cycle(collector)
    assert reg.get_sample_value(xids, moved) == 2
    assert reg.get_sample_value(stamp, moved) == 1_700_000_060.0
    series = [tuple(sorted(s.labels.items())) for f in families if f.name.startswith("syncwatch_gpu_xid")
              for s in f.samples if s.labels["uuid"] == old[4].uuid]
    assert len(series) == 2, series  # one count, one time
    promtool_check(render(families))


def test_gpu_gone_from_the_enumeration_after_nvml_comes_back_reads_down(caplog):
    """GPU 3 falls off the bus, and NVML, initialized again (a driver reset), no longer enumerates
    it: nvmlDeviceGetCount is 7 and its UUID at no index. Its series vanished with it, up 0
    included, and SyncwatchGpuLost resolved (or never fired) just when the GPU was most lost. A
    GPU seen since the daemon started that no index answers with reads up 0 under its last index
    (and nothing else), warned about once, until it is enumerated again."""
    fake = FakeNvml(healthy_node(8))
    old = healthy_node(8)
    collector = GpuCollector(nvml=fake, wall_clock=lambda: 1_700_000_000.0)
    cycle(collector)
    fake.xid(3, 79)
    cycle(collector)
    gone = fake.fall_off_bus(3)
    assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(3)) == 0
    reinit(collector, fake)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        reg, errors, families = cycle(collector)
    assert errors == []
    assert fake.nvmlDeviceGetCount() == 7
    up = "syncwatch_gpu_up"
    assert reg.get_sample_value(up, labels(3)) == 0
    # GPU 4 now has index 3: both series have gpu="3", told apart by their uuid
    assert reg.get_sample_value(up, {"gpu": "3", "uuid": old[4].uuid}) == 1
    assert reg.get_sample_value("syncwatch_gpu_temperature_celsius",
                                {"gpu": "3", "uuid": old[4].uuid}) == old[4].temperature
    text = render(families)
    check_golden("gpu_fell_off_the_bus", text)
    promtool_check(text)
    # only its up series, and the XID counted before it went, as they were
    assert [line for line in text.splitlines()
            if UUID3 in line and not line.startswith("syncwatch_gpu_xid_")] \
        == [f'syncwatch_gpu_up{{gpu="3",uuid="{UUID3}"}} 0.0']
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 1
    assert len([r for r in caplog.records if UUID3 in r.getMessage()]) == 1
    assert "no longer enumerated" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        for _ in range(2):  # stays down, without another warning
            assert cycle(collector)[0].get_sample_value(up, labels(3)) == 0
    assert UUID3 not in caplog.text

    # back on the bus after a reset, now enumerated last: up under the index it has now
    gone.error = None
    fake.enumerate_at_next_init(fake.gpus + [gone])
    reinit(collector, fake)
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        reg, errors, families = cycle(collector)
    assert errors == []
    assert reg.get_sample_value(up, {"gpu": "7", "uuid": UUID3}) == 1
    assert reg.get_sample_value("syncwatch_gpu_temperature_celsius", {"gpu": "7", "uuid": UUID3}) == 43
    assert reg.get_sample_value(up, labels(3)) is None
    assert sum(s.value == 0 for f in families if f.name == up for s in f.samples) == 0
    assert f"gpu 7 ({UUID3}) is enumerated again (it was gpu 3 before it went)" in caplog.text

    # gone again: warned about again (the warning was once per disappearance, not once for good)
    fake.fall_off_bus(7)
    reinit(collector, fake)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        assert cycle(collector)[0].get_sample_value(up, {"gpu": "7", "uuid": UUID3}) == 0
    assert len([r for r in caplog.records if UUID3 in r.getMessage()]) == 1, caplog.text


def test_a_node_that_never_had_the_gpu_is_unaffected():
    """The GPUs remembered are those this daemon saw: a node without GPU 3, its NVML initialized
    again, exports no series for it, and every GPU it has reads up."""
    fake = FakeNvml([g for g in healthy_node(8) if g.uuid != UUID3])
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    reinit(collector, fake)
    _, errors, families = cycle(collector)
    assert errors == []
    assert UUID3 not in render(families)
    ups = [s for f in families if f.name == "syncwatch_gpu_up" for s in f.samples]
    assert len(ups) == 7 and all(s.value == 1 for s in ups)


def test_gpu_enumerated_again_but_unreadable_reads_down_under_both_series():
    """After NVML is initialized again GPU 3 is still enumerated but lost: no UUID is read for
    index 3 (uuid=""), and the collector cannot tell whether it is GPU 3: GPU 3 reads up 0 under
    its UUID (it answers at no index), index 3 up 0 under uuid="". Both are true; the UUID series
    keeps the alert that was firing, and its rank_info join."""
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    fake.gpus[3].error = N.NVML_ERROR_GPU_IS_LOST
    cycle(collector)
    reinit(collector, fake)
    reg = cycle(collector)[0]
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) == 0
    assert reg.get_sample_value("syncwatch_gpu_up", {"gpu": "3", "uuid": ""}) == 0
    fake.gpus[3].error = None
    reg, _, families = cycle(collector)
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) == 1
    assert 'uuid=""' not in render(families)


def test_a_known_gpu_the_daemon_may_no_longer_open_is_not_reported_lost():
    """NVML initialized again answers NO_PERMISSION for index 3 (its device file no longer granted
    to the daemon): its UUID cannot be read, yet GPU 3 may well be that one, healthy. It is not
    reported down (SyncwatchGpuLost would page); the collector errors say index 3 is not watched,
    and that NVML, asked for GPU 3's UUID, answers NO_PERMISSION."""
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    reinit(collector, fake)
    fake.gpus[3].error = N.NVML_ERROR_NO_PERMISSION
    reg, errors, _ = cycle(collector)
    assert len(errors) == 2 and "gpu 3 not watched" in errors[0]
    assert f"{UUID3} (gpu 3 when last read) not watched" in errors[1]
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) is None


def test_fake_nvml_handle_by_uuid_has_pynvml_semantics():
    """nvmlDeviceGetHandleByUUID as pynvml calls it: the UUID as str (pynvml encodes it) or bytes;
    the handle of the GPU listed with it; NOT_FOUND for a UUID no listed GPU has, GPU_IS_LOST
    while a listed GPU is lost (NVML: "if any GPU has fallen off the bus"), the GPU's own error
    for a GPU it finds that answers none (NO_PERMISSION as nvmlDeviceGetHandleByIndex does)."""
    fake = FakeNvml(healthy_node(4))
    with pytest.raises(N.NVMLError_Uninitialized):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(4)[2].uuid)
    fake.nvmlInit()
    for uuid in (healthy_node(4)[2].uuid, healthy_node(4)[2].uuid.encode()):
        handle = fake.nvmlDeviceGetHandleByUUID(uuid)
        assert isinstance(handle, N.c_nvmlDevice_t)
        assert fake.nvmlDeviceGetIndex(handle) == 2
        assert fake.nvmlDeviceGetUUID(handle) == healthy_node(4)[2].uuid
    with pytest.raises(N.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(5)[4].uuid)  # not a GPU of this node
    fake.gpus[1].error = N.NVML_ERROR_NO_PERMISSION
    with pytest.raises(N.NVMLError_NoPermission):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(4)[1].uuid)
    assert fake.nvmlDeviceGetIndex(fake.nvmlDeviceGetHandleByUUID(healthy_node(4)[3].uuid)) == 3
    with pytest.raises(N.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(5)[4].uuid)
    fake.fall_off_bus(0)
    with pytest.raises(N.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(4)[0].uuid)
    with pytest.raises(N.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(5)[4].uuid)
    fake.initialized = 0
    fake.nvmlInit()  # GPU 0 is listed no more
    with pytest.raises(N.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID(healthy_node(4)[0].uuid)


def _gpu_2_gone_gpu_3_forbidden():
    """An 8-GPU node read once; GPU 2 falls off the bus, NVML is initialized again, and GPU 3,
    index 2 at the next init, answers NO_PERMISSION. Returns the node as it was, the fake, the
    collector."""
    old = healthy_node(8)
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    cycle(collector)
    fake.fall_off_bus(2)
    reinit(collector, fake)
    fake.gpus[3].error = N.NVML_ERROR_NO_PERMISSION
    return old, fake, collector


def test_a_gpu_gone_while_another_now_at_its_index_may_not_be_opened():
    """GPU 2 falls off the bus; NVML initialized again lists 7 GPUs, and index 2 (now GPU 3,
    healthy) answers NO_PERMISSION. The missing GPUs were told by their last index: GPU 2's is
    the forbidden one, so it reported nothing, and GPU 3, its index 3 not forbidden, read
    syncwatch_gpu_up{gpu="3"} 0 ("no longer enumerated"): a healthy GPU paged, the gone one
    silent. NVML is now asked for each remembered UUID no index answered with: GPU 2 is not
    found (gone: 0), GPU 3 may not be opened (not watched: an error, no page)."""
    old, fake, collector = _gpu_2_gone_gpu_3_forbidden()
    reg, errors, families = cycle(collector)
    up = "syncwatch_gpu_up"
    assert reg.get_sample_value(up, labels(2)) == 0
    assert [s.labels for f in families for s in f.samples if s.labels.get("uuid") == old[3].uuid] == []
    for index, gpu in enumerate(old[4:], start=3):
        assert reg.get_sample_value(up, {"gpu": str(index), "uuid": gpu.uuid}) == 1
    assert sum(s.value == 0 for f in families if f.name == up for s in f.samples) == 1
    assert len(errors) == 2, errors
    assert "gpu 2 not watched" in errors[0]
    assert old[3].uuid in errors[1] and "Insufficient Permissions" in errors[1]


def test_a_missing_gpu_nvml_does_not_find_while_an_index_may_not_be_opened_is_not_paged():
    """NVML does not document NO_PERMISSION for nvmlDeviceGetHandleByUUID: a real library may
    answer NOT_FOUND for a GPU the daemon may not open. Then a GPU not found may be the one at
    the forbidden index, healthy: while a forbidden index is left that no remembered UUID was
    placed at, a remembered GPU NVML does not find is not reported down (an error says why)."""
    old, fake, collector = _gpu_2_gone_gpu_3_forbidden()
    third = fake.gpus[3]
    by_uuid = fake.nvmlDeviceGetHandleByUUID

    def not_found_when_forbidden(uuid):
        try:
            return by_uuid(uuid)
        except N.NVMLError_NoPermission:
            raise N.NVMLError(N.NVML_ERROR_NOT_FOUND) from None
    fake.nvmlDeviceGetHandleByUUID = not_found_when_forbidden
    reg, errors, families = cycle(collector)
    assert [s.labels for f in families for s in f.samples
            if s.labels.get("uuid") in (old[2].uuid, old[3].uuid)] == []
    assert all(s.value == 1 for f in families if f.name == "syncwatch_gpu_up" for s in f.samples)
    assert len(errors) == 2, errors
    assert old[2].uuid in errors[1] and old[3].uuid in errors[1] and "gpu 2" in errors[1]
    # the permission granted again: GPU 3 read at index 2, GPU 2 down under its last index
    third.error = None
    reg, errors, _ = cycle(collector)
    assert errors == []
    assert reg.get_sample_value("syncwatch_gpu_up", labels(2)) == 0
    assert reg.get_sample_value("syncwatch_gpu_up", {"gpu": "2", "uuid": old[3].uuid}) == 1


def test_labels_match_rank_info_format():
    """gpu = NVML index as a decimal string, uuid = NVML's 'GPU-...' string (as in rank_info)."""
    families = cycle(GpuCollector(nvml=FakeNvml()))[2]
    for fam in families:
        for s in fam.samples:
            assert s.labels["gpu"].isdigit()
            assert s.labels["uuid"].startswith("GPU-")


def test_driver_older_than_the_clock_event_reasons_call():
    """A driver before R535 has no nvmlDeviceGetCurrentClocksEventReasons (pynvml raises
    FUNCTION_NOT_FOUND): the throttle reasons come from the older call with the same bit mask. A
    function the driver lacks altogether (here the energy counter) leaves only its series out.
    Both made every cycle fail, and no throttle series was ever exported on such a node."""
    fake = FakeNvml(driver_lacks={"nvmlDeviceGetCurrentClocksEventReasons",
                                  "nvmlDeviceGetTotalEnergyConsumption"})
    thermal(fake)
    fake.gpus[2].reasons = N.nvmlClocksEventReasonSwPowerCap
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)})
    for _ in range(2):
        runner.run_once()
        reg = registry_of(runner.collect())
        v = reg.get_sample_value
        assert v("syncwatch_collector_success", {"collector": "gpu"}) == 1
        assert v("syncwatch_gpu_throttle_active", labels(5, reason="thermal")) == 1
        assert v("syncwatch_gpu_throttle_active", labels(5, reason="hw_thermal")) == 1
        assert v("syncwatch_gpu_throttle_active", labels(5, reason="power_cap")) == 0
        assert v("syncwatch_gpu_throttle_active", labels(2, reason="power_cap")) == 1
        assert v("syncwatch_gpu_throttle_active", labels(0, reason="thermal")) == 0
        assert v("syncwatch_gpu_energy_joules_total", labels(0)) is None
        assert v("syncwatch_gpu_power_watts", labels(2)) == 302.0


def test_nvidia_ml_py_without_the_unsigned_short_value_type():
    """nvidia-ml-py 12.535.x, which pyproject allows, has no NVML_VALUE_TYPE_UNSIGNED_SHORT
    (12.560 added it): reading the field values' types raised AttributeError past the per-call
    guard, and the node exported no GPU series at all, every cycle (collector success 0)."""
    fake = FakeNvml(healthy_node(2), library_lacks={"NVML_VALUE_TYPE_UNSIGNED_SHORT"})
    with pytest.raises(AttributeError):
        fake.NVML_VALUE_TYPE_UNSIGNED_SHORT  # as on that module
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)})
    runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v("syncwatch_collector_success", {"collector": "gpu"}) == 1
    assert v("syncwatch_gpu_memory_temperature_celsius", labels(1)) == 50
    assert v("syncwatch_gpu_temperature_celsius", labels(1)) == 41


def test_real_nvml_absent_is_quiet_no_data():
    """This machine has no GPU driver: the real nvmlInit() raises NVMLError_LibraryNotFound."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML: the absent case cannot be tested here")
    collector = GpuCollector()  # the real pynvml
    with pytest.raises(NoData):
        collector.update([])
    runner = CollectorRunner({"gpu": collector})
    runner.run_once()
    reg = registry_of(runner.collect())
    assert reg.get_sample_value("syncwatch_collector_success", {"collector": "gpu"}) == 1
    assert not [f for f in runner.collect() if f.name.startswith("syncwatch_gpu")]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_init_retries_with_backoff():
    clock = Clock()
    fake = FakeNvml(init_error=N.NVML_ERROR_DRIVER_NOT_LOADED)
    collector = GpuCollector(nvml=fake, clock=clock, backoff=(10, 40))
    attempts = []
    for step in range(12):  # one update every 5 s for a minute
        calls = fake.calls
        with pytest.raises(NoData):
            collector.update([])
        if fake.calls > calls:
            attempts.append(clock.t - 1000)
        clock.t += 5
    assert attempts == [0, 10, 30]  # backoff 10, 20, then 40 s (next at 70)
    fake.init_error = None
    clock.t = 1070
    assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(0)) == 1


# nvmlInit failures that are errors, not absence. The driver's or the GPUs' trouble: NVML's
# documented UNKNOWN, an interrupt the driver did not get, the driver out of resources
GPU_INIT_ERRORS = [N.NVML_ERROR_UNKNOWN, N.NVML_ERROR_IRQ_ISSUE, N.NVML_ERROR_INSUFFICIENT_RESOURCES]
GPU_INIT_ERROR_IDS = ["unknown", "irq_issue", "insufficient_resources"]
# The daemon's own deployment, the GPUs most likely fine: the driver replaced under the daemon,
# /dev/nvidiactl not granted to it, an NVML library too old for the init call
DAEMON_INIT_ERRORS = [N.NVML_ERROR_LIB_RM_VERSION_MISMATCH, N.NVML_ERROR_NO_PERMISSION,
                      N.NVML_ERROR_FUNCTION_NOT_FOUND]
DAEMON_INIT_ERROR_IDS = ["lib_rm_version_mismatch", "no_permission", "function_not_found"]


@pytest.mark.parametrize("code", GPU_INIT_ERRORS + DAEMON_INIT_ERRORS,
                         ids=GPU_INIT_ERROR_IDS + DAEMON_INIT_ERROR_IDS)
def test_init_failure_other_than_absent_is_an_error(caplog, code):
    """On a node where the daemon never read a GPU: an error, and no GPU series."""
    clock = Clock()
    fake = FakeNvml(init_error=code)
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake, clock=clock)}, clock=clock)
    with caplog.at_level(logging.ERROR, logger="syncwatch.collectors"):
        for _ in range(5):
            runner.run_once()
            families = runner.collect()
            assert registry_of(families).get_sample_value(
                "syncwatch_collector_success", {"collector": "gpu"}) == 0
            assert not [f for f in families if f.name.startswith("syncwatch_gpu")]
            clock.t += 10
    assert f"nvmlInit failed: {N.NVMLError(code)}" in caplog.text


def test_nvml_library_too_old_for_the_init_call_is_an_error(caplog):
    """FUNCTION_NOT_FOUND from nvmlInit: the NVML library is there but lacks the init call
    (nvmlInitWithFlags), a driver too old. It counted as "NVML absent": collector success 1, not
    a word in the log, as on a CPU node. NVML's documented init codes for absence are
    LIBRARY_NOT_FOUND and DRIVER_NOT_LOADED."""
    clock = Clock()
    fake = FakeNvml(init_error=N.NVML_ERROR_FUNCTION_NOT_FOUND)
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake, clock=clock)}, clock=clock)
    with caplog.at_level(logging.ERROR, logger="syncwatch.collectors"):
        runner.run_once()
        clock.t += 5
        runner.run_once()  # inside the backoff: still failing, not quietly absent
    reg = registry_of(runner.collect())
    assert reg.get_sample_value("syncwatch_collector_success", {"collector": "gpu"}) == 0
    assert "nvmlInit failed: Function Not Found" in caplog.text
    assert "driver older than" in caplog.text
    fake.init_error = None
    clock.t += 10
    runner.run_once()
    reg = registry_of(runner.collect())
    assert reg.get_sample_value("syncwatch_collector_success", {"collector": "gpu"}) == 1
    assert reg.get_sample_value("syncwatch_gpu_up", labels(0)) == 1


def test_nvml_failing_after_init_reinitializes():
    clock = Clock()
    fake = FakeNvml()
    collector = GpuCollector(nvml=fake, clock=clock)
    cycle(collector)
    fake.initialized = 0  # driver unloaded under us: every call answers UNINITIALIZED
    with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
        collector.update([])
    assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(0)) == 1
    assert fake.initialized == 1


ABSENT = [N.NVML_ERROR_DRIVER_NOT_LOADED, N.NVML_ERROR_LIBRARY_NOT_FOUND, N.NVML_ERROR_GPU_NOT_FOUND]
ABSENT_IDS = ["driver_not_loaded", "library_not_found", "gpu_not_found"]


@pytest.mark.parametrize("code", ABSENT, ids=ABSENT_IDS)
def test_driver_gone_after_gpus_were_read_reads_them_down(caplog, code):
    """The driver unloads under a node whose GPUs the daemon has read (a reset that does not come
    back): nvmlDeviceGetCount fails, NVML is initialized again, and init answers
    DRIVER_NOT_LOADED (LIBRARY_NOT_FOUND cannot follow a read with pynvml, which loads the library
    once and never unloads it: handled the same, defensively). That counted as "NVML absent", as on a node
    without GPUs: NoData, every GPU series gone, the remembered ones too, success 1 and not a word,
    and SyncwatchGpuLost never fired while every job on the node was dead. GPU_NOT_FOUND ("No
    GPUs were found": pynvml's nvmlInit passes no flag allowing that, so NVML fails init once the
    node's last GPU left the bus) was an init error: the last snapshot, up 1, served for 15 s,
    then every GPU series withdrawn, success 0, and SyncwatchGpuLost never fired. Each GPU read since the
    daemon started now reads up 0 under its last index and UUID (nothing else: its XIDs counted
    before stay), with one warning, through the init retries and their backoff; once the driver
    answers again the GPUs read up."""
    clock = Clock()
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake, clock=clock, wall_clock=lambda: 1_700_000_000.0,
                             backoff=(10, 40))
    runner = CollectorRunner({"gpu": collector}, clock=clock)
    runner.run_once()
    fake.xid(3, 79)
    runner.run_once()
    fake.initialized = 0  # the driver unloads: every call answers UNINITIALIZED ...
    fake.init_error = code  # ... and nvmlInit that it is gone
    runner.run_once()  # nvmlDeviceGetCount fails: NVML closed, initialized again next cycle
    caplog.clear()
    up, success = "syncwatch_gpu_up", {"collector": "gpu"}
    attempts = []
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        for _ in range(12):  # a minute, one cycle every 5 s: init tried at 0, 10, 30 s (backoff)
            clock.t += 5
            calls = fake.calls
            runner.run_once()
            if fake.calls > calls:
                attempts.append(clock.t)
            families = runner.collect()
            v = registry_of(families).get_sample_value
            assert v("syncwatch_collector_success", success) == 1
            for i in range(8):
                assert v(up, labels(i)) == 0, i
            assert v("syncwatch_gpu_temperature_celsius", labels(0)) is None
            assert v("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 1
    assert [t - attempts[0] for t in attempts] == [0, 10, 30]
    text = render([f for f in families if f.name.startswith("syncwatch_gpu_")])
    ups = [line for line in text.splitlines() if not line.startswith(("#", "syncwatch_gpu_xid_"))]
    assert ups == [f'syncwatch_gpu_up{{gpu="{i}",uuid="{g.uuid}"}} 0.0'
                   for i, g in enumerate(healthy_node(8))]
    if code == N.NVML_ERROR_DRIVER_NOT_LOADED:
        check_golden("gpu_driver_unloaded", text)
        promtool_check(text)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert UUID3 in warnings[0].getMessage()
    assert ("NVML finds no GPU" if code == N.NVML_ERROR_GPU_NOT_FOUND else "NVML absent") \
        in warnings[0].getMessage()

    fake.init_error = None  # the driver is back: the GPUs read up at the next init attempt
    clock.t += 40
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v("syncwatch_collector_success", success) == 1
    for i, g in enumerate(healthy_node(8)):
        assert v(up, labels(i)) == 1, i
        assert v("syncwatch_gpu_temperature_celsius", labels(i)) == g.temperature
    assert v("syncwatch_gpu_xid_errors_total", labels(3, xid="79")) == 1
    assert "NVML answers again" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def read_then_fail_init(code):
    """A runner whose 2 GPUs were read (GPU 1 with an XID 79), then the driver reloads and
    nvmlInit fails with ``code``: (clock, fake NVML, runner) after the cycle whose count failed."""
    clock = Clock()
    fake = FakeNvml(healthy_node(2))
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake, clock=clock, backoff=(10, 40))}, clock=clock)
    runner.run_once()
    fake.xid(1, 79)
    runner.run_once()
    fake.initialized = 0  # the driver reloads: every call answers UNINITIALIZED ...
    fake.init_error = code  # ... and nvmlInit fails
    runner.run_once()  # nvmlDeviceGetCount fails: NVML closed, initialized again next cycle
    return clock, fake, runner


@pytest.mark.parametrize("code", GPU_INIT_ERRORS, ids=GPU_INIT_ERROR_IDS)
def test_init_failing_after_gpus_were_read_reads_them_down_and_is_an_error(caplog, code):
    """nvmlInit fails with an error of the driver or the GPUs, not absence, on a node whose GPUs the
    daemon has read (the driver reloaded and failing): the cycles raised, so the runner served the
    last snapshot, every GPU up 1, for 17 s, then withdrew every GPU series, the remembered ones
    too, and SyncwatchGpuLost could not fire. Each GPU read since the daemon started now reads up 0
    under its last index (its XIDs counted before stay), with one warning naming them, and every
    cycle is still the error it was (success 0, nvmlInit's code logged), through the init retries,
    until NVML initializes again."""
    clock, fake, runner = read_then_fail_init(code)
    caplog.clear()
    up, success = "syncwatch_gpu_up", {"collector": "gpu"}
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        for _ in range(12):  # a minute: past stale_after (17 s), when a failing snapshot goes
            clock.t += 5
            runner.run_once()
            v = registry_of(runner.collect()).get_sample_value
            assert v("syncwatch_collector_success", success) == 0
            assert [v(up, labels(i)) for i in range(2)] == [0, 0]
            assert v("syncwatch_gpu_temperature_celsius", labels(0)) is None
            assert v("syncwatch_gpu_xid_errors_total", labels(1, xid="79")) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and labels(1)["uuid"] in warnings[0], caplog.text
    assert str(N.NVMLError(code)) in warnings[0]
    fake.init_error = None
    clock.t += 40
    runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v("syncwatch_collector_success", success) == 1
    assert [v(up, labels(i)) for i in range(2)] == [1, 1]


@pytest.mark.parametrize("code", DAEMON_INIT_ERRORS, ids=DAEMON_INIT_ERROR_IDS)
def test_init_failing_for_the_daemons_fault_after_gpus_were_read_withdraws_them(caplog, code):
    """nvmlInit fails for a fault of the daemon's own deployment on a node whose GPUs it has read
    (the driver replaced at another version under it, /dev/nvidiactl no longer granted to it, an
    NVML library too old): the GPUs are most likely fine, so they do not read up 0, which pages
    SyncwatchGpuLost, critical, for every GPU of the node. The cycles raised: the runner served the
    last snapshot, every GPU up 1, for 17 s after NVML stopped answering, then withdrew every GPU
    series; then they read up 0 like the driver's errors. Now every cycle is the error (success 0,
    nvmlInit's code logged, no warning) and exports no GPU series but the XIDs counted before, from
    the first re-init on, through the init retries, until NVML initializes again."""
    clock, fake, runner = read_then_fail_init(code)
    caplog.clear()
    xids = "syncwatch_gpu_xid_errors_total", "syncwatch_gpu_xid_last_event_timestamp_seconds"
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        for _ in range(12):  # a minute: past stale_after (17 s), when a failing snapshot goes
            clock.t += 5
            runner.run_once()
            families = runner.collect()
            v = registry_of(families).get_sample_value
            assert v("syncwatch_collector_success", {"collector": "gpu"}) == 0
            assert [s.name for f in families if f.name.startswith("syncwatch_gpu")
                    for s in f.samples] == list(xids)
            assert v("syncwatch_gpu_xid_errors_total", labels(1, xid="79")) == 1
    assert [r.levelno for r in caplog.records] == [logging.ERROR], caplog.text  # once a minute
    assert str(N.NVMLError(code)) in caplog.text
    fake.init_error = None
    clock.t += 40
    runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v("syncwatch_collector_success", {"collector": "gpu"}) == 1
    assert [v("syncwatch_gpu_up", labels(i)) for i in range(2)] == [1, 1]


def test_nvml_flapping_after_gpus_were_read_warns_once(caplog):
    """The driver comes and goes (a node whose driver keeps failing): nvmlInit succeeds, the
    count fails, NVML is closed, and the next nvmlInit answers DRIVER_NOT_LOADED. The warning
    re-armed on the init's success: every flap (each retry, ~10 s apart at first) logged "NVML
    answers again" and the warning anew, while no GPU was read in between. It re-arms once a count
    succeeds: one warning through the flapping, one info line when the GPUs are read again."""
    clock = Clock()
    fake = FakeNvml(healthy_node(2))
    collector = GpuCollector(nvml=fake, clock=clock, backoff=(10, 40))
    cycle(collector)
    count, flapping = fake.nvmlDeviceGetCount, [True]

    def flaky_count():
        if flapping[0]:
            raise N.NVMLError(N.NVML_ERROR_UNKNOWN)
        return count()
    fake.nvmlDeviceGetCount = flaky_count
    with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
        collector.update([])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        for _ in range(3):
            clock.t += 60
            fake.init_error = N.NVML_ERROR_DRIVER_NOT_LOADED
            reg = cycle(collector)[0]
            assert reg.get_sample_value("syncwatch_gpu_up", labels(1)) == 0
            clock.t += 60
            fake.init_error = None  # init succeeds, the count fails
            with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
                collector.update([])
    assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.text
    caplog.clear()
    flapping[0] = False
    clock.t += 60
    with caplog.at_level(logging.INFO, logger="syncwatch.collectors"):
        for _ in range(2):
            assert cycle(collector)[0].get_sample_value("syncwatch_gpu_up", labels(1)) == 1
    assert [r.getMessage()[:19] for r in caplog.records] == ["NVML answers again:"], caplog.text


def test_driver_back_without_a_gpu_that_fell_off_the_bus():
    """XID 79: GPU 3 falls off the bus and the driver unloads. While NVML is absent every GPU the
    daemon read reads 0; once it is back without GPU 3, the others read up under their new
    indices, and GPU 3 stays 0 under its last index (gone from the enumeration)."""
    clock = Clock()
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake, clock=clock)
    cycle(collector)
    fake.fall_off_bus(3)
    fake.init_error = N.NVML_ERROR_DRIVER_NOT_LOADED
    reinit(collector, fake)
    reg, errors, families = cycle(collector)
    assert errors == []
    assert [(s.labels["gpu"], s.labels["uuid"], s.value) for f in families for s in f.samples] \
        == [(str(i), g.uuid, 0) for i, g in enumerate(healthy_node(8))]
    fake.init_error = None
    clock.t += 10
    reg, errors, _ = cycle(collector)
    assert errors == []
    old = healthy_node(8)
    for index, gpu in enumerate(old[:3] + old[4:]):
        assert reg.get_sample_value("syncwatch_gpu_up", {"gpu": str(index), "uuid": gpu.uuid}) == 1
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) == 0


@pytest.mark.parametrize("code", ABSENT, ids=ABSENT_IDS)
def test_nvml_absent_on_a_node_that_never_had_gpus_stays_quiet(caplog, code):
    """The fake twin of test_real_nvml_absent_is_quiet_no_data: no GPU was ever read, so NVML
    absent is a node without GPUs: no GPU series, success 1, no warning, retries included.
    GPU_NOT_FOUND at init is a node with a driver installed and no GPU: it was an init error,
    success 0 and SyncwatchCollectorFailing on every such node, where DRIVER_NOT_LOADED (no
    driver) was quiet."""
    clock = Clock()
    fake = FakeNvml(init_error=code)
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake, clock=clock)}, clock=clock)
    with caplog.at_level(logging.WARNING, logger="syncwatch.collectors"):
        for _ in range(5):
            runner.run_once()
            families = runner.collect()
            assert registry_of(families).get_sample_value(
                "syncwatch_collector_success", {"collector": "gpu"}) == 1
            assert not [f for f in families if f.name.startswith("syncwatch_gpu")]
            clock.t += 10
    assert caplog.records == []


def test_driver_replaced_under_the_daemon_is_an_error_that_says_restart_it(caplog):
    """NVML_ERROR_LIB_RM_VERSION_MISMATCH from nvmlInit: the driver was reloaded at another version
    (an upgrade) while this daemon holds the old NVML library, which pynvml loads once per process
    and never unloads, so no retry can clear it: an error (success 0: SyncwatchCollectorFailing)
    that says to restart the daemon. Its GPUs, most likely fine, report no series meanwhile, not
    up 0: SyncwatchGpuLost would page each."""
    clock = Clock()
    fake = FakeNvml(healthy_node(2))
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake, clock=clock)}, clock=clock)
    runner.run_once()
    fake.initialized = 0
    fake.init_error = N.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    runner.run_once()  # nvmlDeviceGetCount fails: NVML initialized again next cycle
    clock.t += 60  # past the runner's once-a-minute error log
    with caplog.at_level(logging.ERROR, logger="syncwatch.collectors"):
        runner.run_once()
    families = runner.collect()
    v = registry_of(families).get_sample_value
    assert v("syncwatch_collector_success", {"collector": "gpu"}) == 0
    assert v("syncwatch_gpu_up", labels(0)) is None
    assert "version mismatch" in caplog.text and "restart the daemon" in caplog.text


def test_golden_gpu_files_pass_promtool():
    text = render(cycle(GpuCollector(nvml=FakeNvml()))[2])
    promtool_check(text)


def fail_once(fake: FakeNvml, function: str, code: int) -> None:
    """The next call of ``function`` raises NVMLError(``code``); the ones after succeed."""
    original = getattr(fake, function)

    def once(*args):
        setattr(fake, function, original)
        raise N.NVMLError(code)
    setattr(fake, function, once)


def test_count_failing_at_setup_leaks_no_event_set_and_xids_are_read():
    """nvmlDeviceGetCount failing right after nvmlEventSetCreate during setup left the new event
    set allocated (never freed) and the collector without one until NVML was initialized again:
    no XID read, without a word."""
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    fail_once(fake, "nvmlDeviceGetCount", N.NVML_ERROR_UNKNOWN)
    with pytest.raises(RuntimeError, match="nvmlDeviceGetCount"):
        collector.update([])  # NVML initialized again next cycle
    cycle(collector)
    assert len(fake._sets) == 1
    fake.xid(2, 31)
    reg, errors, _ = cycle(collector)
    assert errors == []
    assert reg.get_sample_value("syncwatch_gpu_xid_errors_total", labels(2, xid="31")) == 1
    collector.close()
    assert fake._sets == {}


def test_an_event_set_that_cannot_be_made_is_an_error_and_retried():
    """The XID event set could not be made anew after a GPU was lost (nvmlEventSetCreate failed):
    one cycle said so, and every later cycle read no XID at all, success 1, until NVML was
    initialized again. Each cycle without a set now says so, and makes it again."""
    fake = FakeNvml(healthy_node(8))
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake)})
    runner.run_once()
    fake.gpus[3].error = N.NVML_ERROR_GPU_IS_LOST
    fake.driver_lacks.add("nvmlEventSetCreate")  # stands for any failure of the call
    success = "syncwatch_collector_success"
    for _ in range(2):
        fake.xid(0, 13)
        runner.run_once()
        v = registry_of(runner.collect()).get_sample_value
        assert v(success, {"collector": "gpu"}) == 0
        assert v("syncwatch_gpu_up", labels(0)) == 1  # the other metrics still exported
    fake.driver_lacks.clear()
    runner.run_once()
    fake.xid(0, 13)
    runner.run_once()
    v = registry_of(runner.collect()).get_sample_value
    assert v(success, {"collector": "gpu"}) == 1
    assert v("syncwatch_gpu_xid_errors_total", labels(0, xid="13")) == 1
    assert len(fake._sets) == 1


def test_xids_counted_before_the_uuid_was_read_take_it_once_known():
    """A GPU that answered its registration for XIDs but not its UUID (it timed out) had its
    XIDs counted under uuid="", and they stayed there after the UUID was read: a series no
    syncwatch_rank_info joins. They move to the UUID once it is known."""
    fake = FakeNvml(healthy_node(8))
    collector = GpuCollector(nvml=fake)
    original = fake.nvmlDeviceGetUUID
    timing_out = {3}

    def uuid(handle):
        if fake._index(handle) in timing_out:
            raise N.NVMLError(N.NVML_ERROR_TIMEOUT)
        return original(handle)
    fake.nvmlDeviceGetUUID = uuid
    reg = cycle(collector)[0]
    assert reg.get_sample_value("syncwatch_gpu_up", {"gpu": "3", "uuid": ""}) == 0
    fake.xid(3, 79)
    reg = cycle(collector)[0]
    xids, stamp = "syncwatch_gpu_xid_errors_total", "syncwatch_gpu_xid_last_event_timestamp_seconds"
    assert reg.get_sample_value(xids, {"gpu": "3", "uuid": "", "xid": "79"}) == 1
    timing_out.clear()
    reg, _, families = cycle(collector)
    assert reg.get_sample_value("syncwatch_gpu_up", labels(3)) == 1
    assert reg.get_sample_value(xids, labels(3, xid="79")) == 1
    assert reg.get_sample_value(stamp, labels(3, xid="79")) is not None
    assert 'uuid=""' not in render(families)


def _smi(fields: str) -> list[list[str]]:
    """``nvidia-smi --query-gpu=<fields>``: one row per GPU, in NVML's order."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


@pytest.mark.gpu
def test_real_nvml_reads_this_machines_gpus():
    """The real pynvml on a machine with a GPU (skipped without one): every GPU is up and
    exported under its own index and UUID, without a collector error (an NVML call that the
    driver refuses here, other than NOT_SUPPORTED, is one), in the units nvidia-smi reads: °C,
    W, Hz; energy grows at about the power drawn; the rank's UUID from torch is NVML's, so the
    rules join the ranks to their GPUs."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVML here (no GPU driver)")
    pynvml.nvmlShutdown()
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi not found")
    collector = GpuCollector()  # the real pynvml
    try:
        first, errors, _ = cycle(collector)
        assert errors == []
        time.sleep(2.0)
        second, errors, families = cycle(collector)
        assert errors == []
    finally:
        collector.close()
    smi = _smi("index,uuid,temperature.gpu,power.draw,clocks.max.sm")
    a, b = first.get_sample_value, second.get_sample_value
    for index, uuid, temp, watts, max_mhz in smi:
        gpu = {"gpu": index, "uuid": uuid}
        assert b("syncwatch_gpu_up", gpu) == 1, gpu
        assert b("syncwatch_gpu_temperature_celsius", gpu) == pytest.approx(float(temp), abs=5)
        power = b("syncwatch_gpu_power_watts", gpu)
        assert power == pytest.approx(float(watts), rel=0.3, abs=15)
        assert 0 < b("syncwatch_gpu_sm_clock_hertz", gpu) <= float(max_mhz) * 1e6
        assert 0 <= b("syncwatch_gpu_utilization_ratio", gpu) <= 1
        joules = b("syncwatch_gpu_energy_joules_total", gpu) - a("syncwatch_gpu_energy_joules_total", gpu)
        assert 0.5 * 2.0 * power < joules < 2.0 * 2.5 * power, (joules, power)  # 2 s at that power
        reasons = [s for f in families if f.name == "syncwatch_gpu_throttle_active"
                   for s in f.samples if s.labels["uuid"] == uuid]
        assert len(reasons) == len(THROTTLE_REASONS) + 1 and {s.value for s in reasons} <= {0, 1}
    torch = pytest.importorskip("torch")
    from syncwatch.instrument.identity import cuda_uuid
    if torch.cuda.is_available():
        assert {cuda_uuid(i) for i in range(torch.cuda.device_count())} <= {row[1] for row in smi}
