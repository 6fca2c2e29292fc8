"""The simulated hardware (``syncwatch.sim.hardware``) read through the real collectors, advanced
tick by tick from a model-only driver (fast mode, no daemons): every reading must follow the
simulator's truth."""

from __future__ import annotations

import time

import pytest

from syncwatch.sim.driver import Driver, gpu_uuid
from syncwatch.sim.hardware import (BASE_CLOCK_MHZ, CONGESTED_STEP, IDLE_POWER_MW,
                                    NIC_PACKET_BYTES, QUIET_STEP, ROCE_PACKET_BYTES,
                                    SimulatedHardware, THROTTLE_HEAT)
from syncwatch.sim.scenarios import ScenarioThread, scenario_params, straggler_rank


def _setup(scenario: str, nodes: int = 2, ranks: int = 2, **params):
    driver = Driver(scenario_params(scenario, nodes, ranks, **params), seed=3, keep_steps=True)
    hw = SimulatedHardware(nodes, ranks, "sim-node-", period=3600)  # ticks by hand below
    hw.follow(driver)
    return driver, hw


def _read(hw: SimulatedHardware, n: int) -> dict:
    """{(metric sample name, frozenset(labels)): value} from node ``n``'s real collectors."""
    runner = hw.nodes[n].collectors(1.0)
    runner.run_once()
    out = {}
    for fam in runner.collect():
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    runner.stop()
    return out


def _gpu(values: dict, metric: str, uuid: str, **labels) -> float:
    (v,) = [x for (name, ls), x in values.items()
            if name == metric and ("uuid", uuid) in ls and set(labels.items()) <= ls]
    return v


def _port(values: dict, metric: str) -> float:
    return values[(metric, frozenset({"device": "mlx5_0", "port": "1"}.items()))]


@pytest.mark.parametrize("amplitude", [0.06, -0.06])
def test_thermal_hot_node_follows_the_models_sinusoid(amplitude):
    """The slowest node is the hottest whatever the amplitude's sign (a negative one only shifts
    the sinusoid): at -0.06 the heat was divided by the signed amplitude, and a node computing
    5 % faster read 83 degrees, throttled at 2093 MHz, while the slowest read 47."""
    driver, hw = _setup("thermal", nodes=4, ranks=2, thermal_amplitude=amplitude)
    with hw:
        seen_throttled = set()
        for _ in range(12):                       # one 300-step period, every 25 steps
            driver.run(25)
            hw.tick(1.0)
            factors = driver.model.node_factors(driver.truth.last_step)
            readings = [_read(hw, n) for n in range(4)]
            temps = [_gpu(r, "syncwatch_gpu_temperature_celsius", gpu_uuid(f"sim-node-{n:02d}", 0))
                     for n, r in enumerate(readings)]
            hottest = max(range(4), key=factors.__getitem__)
            assert max(range(4), key=temps.__getitem__) == hottest
            for n, r in enumerate(readings):
                uuid = gpu_uuid(f"sim-node-{n:02d}", 0)
                heat = (factors[n] - 1) / 0.06
                throttled = _gpu(r, "syncwatch_gpu_throttle_active", uuid, reason="sw_thermal")
                assert throttled == (1.0 if heat >= THROTTLE_HEAT else 0.0)
                if throttled:
                    seen_throttled.add(n)
                clock = _gpu(r, "syncwatch_gpu_sm_clock_hertz", uuid)
                assert clock == pytest.approx(BASE_CLOCK_MHZ / factors[n] * 1e6, rel=1e-3)
        assert seen_throttled, "no node got hot enough to throttle in a whole period"


def test_straggler_gpu_is_hot_and_slow_once_it_straggles():
    driver, hw = _setup("straggler", nodes=2, ranks=4)
    rank = straggler_rank(8)
    node, local = divmod(rank, 4)
    with hw:
        driver.run(10)                            # before straggler_from_step (20)
        hw.tick(1.0)
        early = _read(hw, node)
        assert _gpu(early, "syncwatch_gpu_throttle_active", gpu_uuid(f"sim-node-{node:02d}", local),
                    reason="sw_thermal") == 0
        driver.run(20)
        hw.tick(1.0)
        for n in range(2):
            r = _read(hw, n)
            for g in range(4):
                uuid = gpu_uuid(f"sim-node-{n:02d}", g)
                slow = (n, g) == (node, local)
                assert _gpu(r, "syncwatch_gpu_throttle_active", uuid, reason="sw_thermal") == float(slow)
                assert (_gpu(r, "syncwatch_gpu_temperature_celsius", uuid) >= 80) == slow
                assert _gpu(r, "syncwatch_gpu_sm_clock_hertz", uuid) == pytest.approx(
                    (BASE_CLOCK_MHZ / 1.08 if slow else BASE_CLOCK_MHZ) * 1e6, rel=1e-3)


def test_gpu_readings_are_the_documented_ones_whatever_the_step_did():
    """docs/simulator.md said the SM clock follows "the compute slowdown the model applies to
    that rank" and the temperature 65 + 20 h: the clock is 1980 MHz over the thermal and
    straggler factors alone (a tick is no step: the oscillation's ± 10 % and the jitter move
    no clock), and a node's GPUs read local % 3 degrees apart."""
    driver, hw = _setup("oscillation", nodes=2, ranks=4, thermal_amplitude=0.06,
                        straggler_rank=6, straggler_slowdown=0.2, straggler_from_step=0)
    with hw:
        for steps in (7, 1):                      # ending on an odd step, then an even one
            driver.run(steps)
            hw.tick(1.0)
            factors = driver.model.node_factors(driver.truth.last_step)
            for n in range(2):
                r = _read(hw, n)
                for g in range(4):
                    uuid = gpu_uuid(f"sim-node-{n:02d}", g)
                    slow = n * 4 + g == 6
                    heat = 1.0 if slow else (factors[n] - 1) / 0.06
                    assert _gpu(r, "syncwatch_gpu_temperature_celsius", uuid) == (
                        round(65 + 20 * heat) + g % 3)
                    assert _gpu(r, "syncwatch_gpu_sm_clock_hertz", uuid) == pytest.approx(
                        BASE_CLOCK_MHZ / (factors[n] * (1.2 if slow else 1.0)) * 1e6, rel=1e-3)


def test_congestion_episodes_raise_fabric_counters_on_every_node():
    driver, hw = _setup("congestion", nodes=2, ranks=2)
    with hw:
        before = [_read(hw, n) for n in range(2)]
        driver.run(99)                            # quiet: the first episode starts at step 100
        hw.tick(1.0)
        quiet = [_read(hw, n) for n in range(2)]
        driver.run(20)
        hw.tick(1.0)
        episode = [_read(hw, n) for n in range(2)]
    assert driver.truth.congested_steps == 20
    for n in range(2):
        for metric, key in (("syncwatch_ib_port_xmit_wait_total", "port_xmit_wait"),
                            ("syncwatch_roce_cnp_sent_total", "np_cnp_sent"),
                            ("syncwatch_roce_cnp_handled_total", "rp_cnp_handled"),
                            ("syncwatch_roce_ecn_marked_total", "np_ecn_marked_roce_packets")):
            assert _port(quiet[n], metric) - _port(before[n], metric) == 99 * QUIET_STEP[key]
            assert _port(episode[n], metric) - _port(quiet[n], metric) == 20 * CONGESTED_STEP[key]
        # traffic follows steps: a 2-node ring moves the whole 256 MiB gradient each way per step
        key = ("syncwatch_ib_port_data_bytes_total",
               frozenset({"device": "mlx5_0", "port": "1", "direction": "transmit"}.items()))
        assert episode[n][key] - before[n][key] == 119 * 256 * 2**20


def test_the_drivers_steps_tick_the_hardware_in_lockstep():
    """Ticks run in the driver's thread after a step's records: the counters read right after
    ``run()`` returns hold every step, with no tick by hand and no ticker thread (period 3600 s
    for the thread, then 0: due after every step)."""
    driver, hw = _setup("congestion", nodes=2, ranks=2)
    hw.period = 0.0
    metric = "syncwatch_ib_port_xmit_wait_total"
    with hw:
        before = _port(_read(hw, 1), metric)
        for steps in (1, 98, 7, 20):              # through the first episode (steps 100-119)
            driver.run(steps)
            truth = driver.truth
            quiet = truth.executed_steps - truth.congested_steps
            assert _port(_read(hw, 1), metric) - before == (
                quiet * QUIET_STEP["port_xmit_wait"] + truth.congested_steps * CONGESTED_STEP["port_xmit_wait"])
    assert driver.truth.congested_steps == 20


def test_energy_accumulates_power_and_idles_without_steps():
    driver, hw = _setup("healthy", nodes=1, ranks=1)
    uuid = gpu_uuid("sim-node-00", 0)
    with hw:
        e0 = _gpu(_read(hw, 0), "syncwatch_gpu_energy_joules_total", uuid)
        driver.run(5)
        hw.tick(2.0)
        busy = _read(hw, 0)
        hw.tick(2.0)                              # no step since: idle
        idle = _read(hw, 0)
    assert _gpu(busy, "syncwatch_gpu_power_watts", uuid) == pytest.approx(400.0)
    assert _gpu(busy, "syncwatch_gpu_energy_joules_total", uuid) - e0 == pytest.approx(800.0)
    assert _gpu(idle, "syncwatch_gpu_power_watts", uuid) == pytest.approx(90.0)
    assert (_gpu(idle, "syncwatch_gpu_energy_joules_total", uuid)
            - _gpu(busy, "syncwatch_gpu_energy_joules_total", uuid)) == pytest.approx(180.0)


def test_follow_rejects_a_driver_of_another_shape():
    with SimulatedHardware(2, 2, "sim-node-") as hw:
        with pytest.raises(ValueError, match="3 nodes"):
            hw.follow(Driver(scenario_params("healthy", 3, 2)))


def test_gpus_read_busy_for_a_whole_real_time_run_and_idle_while_it_is_down():
    """A real-time run whose steps outlast the ticker's period, with a restart: the GPUs read busy
    whenever a step is under way (after at most a period into the attempt's first step), idle
    during the restart's downtime and after the run. A tick of the ticker thread mid-step saw no
    step ended and read them idle for most of the run (0 % and 90 W)."""
    period = 0.05
    params = dict(compute_seconds=0.25, checkpoint_every=4, checkpoint_seconds=0.0,
                  fail_after=(5,), restart_seconds=2.0)
    thread = ScenarioThread("restarts", None, 1, 2, steps=10, params=params)
    driver = thread.driver
    samples = []       # (seconds since the stepping stretch began, stepping, utilization, power)
    with SimulatedHardware(1, 2, "sim-node-", period=period) as hw:
        gpu = hw.nodes[0].nvml.gpus[1]
        hw.follow(driver)
        thread.start()
        began = None
        while thread.is_alive():
            stepping, utilization = driver.stepping, gpu.utilization
            now = time.monotonic()
            if stepping and began is None:
                began = now
            elif not stepping:
                began = None
            samples.append((now - began if stepping else None, stepping, utilization, gpu.power_mw))
            time.sleep(0.01)
        thread.join()
        assert thread.error is None and driver.truth.attempt == 1
        deadline = time.monotonic() + 5.0             # the run is over: idle from the next tick
        while gpu.utilization and time.monotonic() < deadline:
            time.sleep(period)
        assert (gpu.utilization, gpu.power_mw) == (0, IDLE_POWER_MW)
    stepping = [s for s in samples if s[1]]
    assert len(stepping) > 100
    late_idle = [s for s in stepping if s[0] > 0.5 and s[2] == 0]
    assert not late_idle, f"{len(late_idle)} of {len(stepping)} samples mid-run read idle GPUs"
    assert any(s[2] == 95 and s[3] == 400_000 for s in stepping)
    down = [s for s in samples if not s[1]]
    assert any(s[2] == 0 for s in down), "the GPUs never read idle while the job was down"


def test_packet_counters_move_with_the_bytes():
    """The NIC's and the RoCE port's packet counters follow their bytes, as real counters do: they
    never moved, so the demo showed ~600 MB/s at 0 packets/s."""
    driver, hw = _setup("healthy", nodes=2, ranks=2)

    def nic(values: dict, metric: str) -> float:
        (v,) = [x for (name, _), x in values.items() if name == metric]
        return v

    def port_file(name: str) -> int:
        return int((hw.nodes[0].port / "counters" / name).read_text())

    with hw:
        before = _read(hw, 0)
        port_before = {f: port_file(f) for f in ("port_xmit_packets", "port_rcv_packets",
                                                  "unicast_xmit_packets", "unicast_rcv_packets")}
        driver.run(7)
        hw.tick(1.0)
        after = _read(hw, 0)
        for direction in ("receive", "transmit"):
            nbytes = (nic(after, f"syncwatch_nic_{direction}_bytes_total")
                      - nic(before, f"syncwatch_nic_{direction}_bytes_total"))
            packets = (nic(after, f"syncwatch_nic_{direction}_packets_total")
                       - nic(before, f"syncwatch_nic_{direction}_packets_total"))
            assert nbytes > 0 and packets == -(-nbytes // NIC_PACKET_BYTES)
        # a 2-node ring moves the whole 256 MiB gradient each way per step
        for direction in ("transmit", "receive"):
            key = ("syncwatch_ib_port_data_bytes_total",
                   frozenset({"device": "mlx5_0", "port": "1", "direction": direction}.items()))
            assert after[key] - before[key] == 7 * 256 * 2**20
        for name, value in port_before.items():
            assert port_file(name) - value == 7 * 256 * 2**20 // ROCE_PACKET_BYTES, name


def test_port_counters_stop_at_their_fields_maximum(tmp_path):
    """A PMA counter saturates at its field's maximum, as ``ib_port`` (which refuses wider values)
    and the kernel's fields have it: ``Counters.bump`` went on past it, and the congestion
    scenario passed port_xmit_wait's 2**32 - 1 after ~52.6k steps. Netdev statistics and
    hw_counters are 64-bit: not capped."""
    from syncwatch.sim import sysfs_tree
    from syncwatch.sim.hardware import NodeHardware
    node = NodeHardware("sim-node-00", 1, tmp_path)
    counters, read = node.port / "counters", (lambda path: int(path.read_text()))
    steps = 11_000  # 11000 x 400000 > 2**32
    node.move(port_bytes=0, nic_in=1, quiet_steps=0, congested_steps=steps)
    assert read(counters / "port_xmit_wait") == 2**32 - 1
    assert read(node.port / "hw_counters" / "np_cnp_sent") == steps * CONGESTED_STEP["np_cnp_sent"]
    node.move(port_bytes=0, nic_in=1, quiet_steps=1, congested_steps=0)
    assert read(counters / "port_xmit_wait") == 2**32 - 1          # stays there
    bump = node.counters.bump
    for name, width in sysfs_tree.PMA_WIDTHS.items():
        bump(counters / name, 2**width)
        assert read(counters / name) == 2**width - 1, name
    stats = node.nic / "statistics" / "rx_packets"              # a netdev counter: no PMA field
    before = read(stats)
    bump(stats, 2**40)
    assert read(stats) == before + 2**40


def test_packet_sizes_agree_with_the_nics_mtu(tmp_path):
    """The netdev's mtu file said 9000 while its packet counters counted 1500-byte frames. Both
    packet sizes follow the mtu file: the netdev's full frames are its MTU, and the RoCE port's
    packets the largest RDMA MTU that fits in it with the RoCE headers (the kernel's
    ``iboe_get_mtu``: GRH, UDP, BTH, XRC and AtomicETH extension headers and ICRC, 96 bytes)."""
    from syncwatch.sim.hardware import NodeHardware
    node = NodeHardware("sim-node-00", 1, tmp_path)
    mtu = int((node.nic / "mtu").read_text())
    assert NIC_PACKET_BYTES == mtu
    assert ROCE_PACKET_BYTES == max(m for m in (256, 512, 1024, 2048, 4096) if m <= mtu - 96)
