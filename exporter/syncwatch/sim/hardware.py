"""The hardware of simulated nodes: fake GPUs and a fake fabric, driven by the simulator's truth.

Per simulated node: a ``FakeNvml`` with one GPU per local rank (uuid ``driver.gpu_uuid(node,
local)``, so the GPU series join the ranks' ``syncwatch_rank_info`` on ``uuid``) and a sysfs tree
in a temporary directory holding one RoCE NIC as a real mlx5 host shows it: the netdev
``class/net/ens1f0np0`` and its HCA port ``class/infiniband/mlx5_0/ports/1`` (link layer Ethernet,
``counters/`` and ``hw_counters/``). The real collectors (``collectors.gpu``, ``net``,
``infiniband``) read them inside each node's daemon (``NodeHardware.collectors``).

Following a running ``Driver``, a tick advances everything from what the model did since the
last tick, never from a model of its own. Ticks run in the driver's thread after a step's
records went out, at most every ``period`` seconds, so the counters move in lockstep with the
records: a ticker thread of their own fell seconds behind on a loaded machine (each tick's file
writes wait for the interpreter lock), which put the counters of a congestion episode into the
next analysis window. A ticker thread ticks while the driver runs no step (``Driver.stepping``
false: before the run, a restart's downtime, the run over), and once a period into a step that
finds the GPUs idle (the run's or an attempt's first), to mark them busy. The GPUs are busy over
a tick's interval where a step is under way at the tick or one ended since the last tick, idle
otherwise:

| reading | from the simulator's truth |
| --- | --- |
| GPU heat h in [-1, 1] | thermal scenario: the node's sinusoid, (``Model.node_factors`` - 1) / abs(amplitude); straggler: 1 on the slow rank's GPU once it straggles; otherwise 0 |
| temperature | 65 + 20 h °C, rounded, + local % 3; the ``sw_thermal`` throttle reason is active while h >= 0.75 (80 °C) |
| SM clock | 1980 MHz / (thermal x straggler): not the per-step jitter, oscillation or stalls |
| utilisation | 95 % while busy, else 0 |
| power, energy | while busy 250 W + 150 W x clock / 1980 MHz, else 90 W; energy += power x time |
| RoCE port data | every step a ring all-reduce moves 2 (N - 1) / N x ``GRADIENT_BYTES`` out and in |
| NIC bytes | data loading: samples x ``SAMPLE_BYTES`` in, a fiftieth of that out |
| packets | each tick's bytes / ``NIC_PACKET_BYTES`` (9000, the netdev's ``NIC_MTU``) on the netdev, / ``ROCE_PACKET_BYTES`` (4096, the RDMA MTU that fits in it) on the port (``port_*_packets``, ``unicast_*_packets``), rounded up |
| ``port_xmit_wait``, CNP sent / handled, ECN marked | a trickle per quiet step, much more per step of a congestion episode, on every node |
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pynvml

from ..collectors import CollectorRunner
from ..collectors.fake_nvml import FakeGpu, FakeNvml
from ..collectors.gpu import GpuCollector
from ..collectors.infiniband import InfinibandCollector
from ..collectors.net import NetCollector
from . import sysfs_tree
from .driver import Driver, gpu_uuid, node_name

NIC, HCA = "ens1f0np0", "mlx5_0"
GRADIENT_BYTES = 256 * 2**20        # gradients all-reduced per step
SAMPLE_BYTES = 150_000              # one training sample as loaded over the NIC
# the netdev's MTU (its mtu file): jumbo frames, as a RoCE fabric runs them, since the RoCE
# port's RDMA MTU is the largest that fits in it with the RoCE headers (the kernel's
# iboe_get_mtu): 4096 takes an MTU of at least 4192, the default 1500 gives 1024
NIC_MTU = 9000
# bytes per packet, as the counters count them: the netdev's full frames at its MTU, the RoCE
# port's at its RDMA MTU
NIC_PACKET_BYTES, ROCE_PACKET_BYTES = NIC_MTU, 4096
BASE_CLOCK_MHZ = 1980
BASE_TEMPERATURE, HEAT_CELSIUS, THROTTLE_HEAT = 65, 20, 0.75
IDLE_POWER_MW, BUSY_POWER_MW, CLOCK_POWER_MW = 90_000, 250_000, 150_000
THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
# hw_counters / counters advanced per step: quiet, and inside a congestion episode
QUIET_STEP = {"port_xmit_wait": 2_000, "np_cnp_sent": 2, "rp_cnp_handled": 2, "np_ecn_marked_roce_packets": 3}
CONGESTED_STEP = {"port_xmit_wait": 400_000, "np_cnp_sent": 3_000, "rp_cnp_handled": 2_800,
                  "np_ecn_marked_roce_packets": 5_000}


class NodeHardware:
    """One simulated node's GPUs (``nvml``) and sysfs tree (``root``)."""

    def __init__(self, node: str, gpus: int, root: Path):
        self.node, self.root = node, root
        self.nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(node, local), temperature=BASE_TEMPERATURE,
                                      power_mw=IDLE_POWER_MW, energy_mj=10**9, utilization=0)
                              for local in range(gpus)])
        self.nic = sysfs_tree.nic(root, NIC, speed="200000", mtu=NIC_MTU)
        self.port = sysfs_tree.ib_port(root, HCA, 1, link_layer="Ethernet")
        self.counters = sysfs_tree.Counters()

    def collectors(self, interval: float) -> CollectorRunner:
        """The daemon's ``extra_collectors`` entry: the real GPU, NIC and InfiniBand collectors."""
        root = str(self.root)
        return CollectorRunner({"gpu": GpuCollector(nvml=self.nvml), "net": NetCollector(sysfs=root),
                                "infiniband": InfinibandCollector(sysfs=root)},
                               interval=interval)

    def set_gpu(self, local: int, heat: float, slowdown: float) -> None:
        """GPU ``local`` at ``heat`` (-1..1), computing ``slowdown`` x slower than nominal."""
        gpu = self.nvml.gpus[local]
        gpu.temperature = round(BASE_TEMPERATURE + HEAT_CELSIUS * heat) + local % 3
        gpu.reasons = THERMAL if heat >= THROTTLE_HEAT else 0
        gpu.sm_clock_mhz = round(BASE_CLOCK_MHZ / slowdown)

    def run_gpus(self, seconds: float, busy: bool) -> None:
        for gpu in self.nvml.gpus:
            gpu.utilization = 95 if busy else 0
            gpu.power_mw = (BUSY_POWER_MW + CLOCK_POWER_MW * gpu.sm_clock_mhz // BASE_CLOCK_MHZ
                            if busy else IDLE_POWER_MW)
            gpu.energy_mj += int(gpu.power_mw * seconds)    # mW x s = mJ

    def move(self, *, port_bytes: int, nic_in: int, quiet_steps: int, congested_steps: int) -> None:
        if not (quiet_steps or congested_steps):
            return  # no step since the last tick: nothing moved
        stats, counters, hw = self.nic / "statistics", self.port / "counters", self.port / "hw_counters"
        bump = self.counters.bump
        for direction, nbytes in (("rx", nic_in), ("tx", nic_in // 50)):
            bump(stats / f"{direction}_bytes", nbytes)
            bump(stats / f"{direction}_packets", _packets(nbytes, NIC_PACKET_BYTES))
        packets = _packets(port_bytes, ROCE_PACKET_BYTES)
        for direction in ("xmit", "rcv"):
            bump(counters / f"port_{direction}_data", port_bytes // 4)   # sysfs counts 4-byte words
            bump(counters / f"port_{direction}_packets", packets)
            bump(counters / f"unicast_{direction}_packets", packets)      # RDMA traffic is unicast
        for name in QUIET_STEP:
            by = QUIET_STEP[name] * quiet_steps + CONGESTED_STEP[name] * congested_steps
            bump((counters if name == "port_xmit_wait" else hw) / name, by)


def _packets(nbytes: int, packet_bytes: int) -> int:
    """Packets that carry ``nbytes``: full ones and one for the remainder."""
    return -(-nbytes // packet_bytes)


def _memory_dir() -> str | None:
    """A directory in memory for the sysfs trees, as sysfs is (None: the default temp directory).
    Ticks replace dozens of counter files: ~30 us each on tmpfs, ~0.5 ms on a journaled disk."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


class SimulatedHardware:
    """Every node of one simulated job; ``follow(driver)`` starts advancing it, ``close()`` ends it.

        hw = SimulatedHardware(nodes, ranks_per_node, node_prefix)
        daemons = [DaemonThread(config_n, extra_collectors=(hw.nodes[n].collectors(1.0),)) ...]
        thread = ScenarioThread(..., node_prefix=node_prefix); hw.follow(thread.driver); thread.start()
    """

    def __init__(self, nodes: int, ranks_per_node: int, node_prefix: str, *, period: float = 0.5):
        self.period = period
        self.dir = Path(tempfile.mkdtemp(prefix="syncwatch-hw-", dir=_memory_dir()))
        self.nodes = [NodeHardware(node_name(node_prefix, n), ranks_per_node, self.dir / f"node{n:02d}")
                      for n in range(nodes)]
        self._driver: Driver | None = None
        self._seen = (0, 0)                 # (executed, congested) steps at the last tick
        self._busy = False                  # the last tick found the GPUs busy
        self._last = time.monotonic()       # when the last tick ran
        self._lock = threading.Lock()       # the driver's thread and the ticker thread both tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, driver: Driver) -> None:
        """Advance the hardware from ``driver`` every ``period`` seconds: after its steps, in its
        thread, and in a daemon thread while it runs no step."""
        if driver.p.nodes != len(self.nodes):
            raise ValueError(f"driver has {driver.p.nodes} nodes, the hardware {len(self.nodes)}")
        self._driver = driver
        self._seen = (driver.truth.executed_steps, driver.truth.congested_steps)
        self._last = time.monotonic()
        driver.after_step.append(self._tick_if_due)
        self._thread = threading.Thread(target=self._run, name="syncwatch-sim-hardware", daemon=True)
        self._thread.start()

    def _tick_if_due(self) -> None:
        if time.monotonic() - self._last >= self.period:
            with self._lock:
                now = time.monotonic()
                # the other thread may have just ticked; after close() the files are gone
                if now - self._last >= self.period and not self._stop.is_set():
                    self.tick(now - self._last)
                    self._last = now

    def _run(self) -> None:
        # while the driver steps, its own thread ticks after each step; this one ticks mid-step
        # only to mark idle GPUs busy once steps start (the run's or an attempt's first): a tick
        # mid-step saw no step ended and read them idle, most of a run whose steps outlast the period
        while not self._stop.wait(self.period):
            if not (self._driver.stepping and self._busy):
                self._tick_if_due()

    def tick(self, seconds: float) -> None:
        """Advance by ``seconds`` of real time and the steps the driver executed since the last tick."""
        driver = self._driver
        p, truth = driver.p, driver.truth
        executed, congested = truth.executed_steps, truth.congested_steps
        steps, hot_steps = executed - self._seen[0], congested - self._seen[1]
        self._seen = (executed, congested)
        step = truth.last_step
        factors = driver.model.node_factors(step)
        straggling = p.straggler_rank >= 0 and p.straggler_slowdown > 0 and step >= p.straggler_from_step
        ring = 2 * (p.nodes - 1) / p.nodes if p.nodes > 1 else 0.0
        self._busy = busy = steps > 0 or driver.stepping
        for n, node in enumerate(self.nodes):
            # the size of the swing: a negative amplitude only shifts the sinusoid's phase, and
            # dividing by it made the slowest node the coldest and the fastest throttle
            heat = (factors[n] - 1.0) / abs(p.thermal_amplitude) if p.thermal_amplitude else 0.0
            for local in range(p.ranks_per_node):
                if straggling and n * p.ranks_per_node + local == p.straggler_rank:
                    node.set_gpu(local, 1.0, factors[n] * (1.0 + p.straggler_slowdown))
                else:
                    node.set_gpu(local, heat, factors[n])
            node.run_gpus(seconds, busy)
            node.move(port_bytes=int(steps * ring * GRADIENT_BYTES),
                      nic_in=int(steps * p.ranks_per_node * p.samples_per_step * SAMPLE_BYTES),
                      quiet_steps=steps - hot_steps, congested_steps=hot_steps)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:  # a tick under way in the driver's thread ends first
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SimulatedHardware":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
