"""GPUs through NVML (pynvml from nvidia-ml-py).

The NVML module is a constructor argument (``nvml=pynvml`` in production, ``FakeNvml`` in tests and
demos), so everything here is exercised on machines without a GPU.

Failure semantics:

* NVML absent (no library, no driver: ``LIBRARY_NOT_FOUND``, ``DRIVER_NOT_LOADED``), or finding
  no GPU (``GPU_NOT_FOUND``: pynvml's ``nvmlInit`` passes flags 0, so NVML fails init on a node
  with a driver and no GPU), on a node where this daemon never read a GPU: ``NoData``, quietly (a
  node without GPUs); other init failures are errors, ``FUNCTION_NOT_FOUND`` included (a library
  too old for the init call: a driver to upgrade, not a node without GPUs), and
  ``LIB_RM_VERSION_MISMATCH`` (the driver reloaded at another version under the daemon, whose
  library pynvml never reloads: restart the daemon). Either way initialization is retried with
  exponential backoff (10 s doubling to 5 min).
* NVML absent, or finding no GPU, once the daemon has read GPUs (NVML initialized again after a
  failure, e.g. of ``nvmlDeviceGetCount`` in a driver reset, and the driver stays unloaded, or the
  node's only GPUs left the bus): no node without GPUs but a failure of all of them.
  ``LIBRARY_NOT_FOUND`` cannot follow a read with pynvml, which loads the library once per
  process and never unloads it (``nvmlShutdown`` leaves it loaded); it is handled the same way,
  defensively (another NVML module, e.g. a fake). Every GPU it remembers (below) reports
  ``syncwatch_gpu_up{gpu=<its last index>, uuid} 0`` and none of its values (its XIDs counted
  before stay), with one warning (not one per retry), through the init retries and their backoff;
  once NVML initializes again the GPUs it lists read up under their indices (an info line says
  so), and those it no longer lists stay 0 as below. Not a collector error (success 1): like a
  lost GPU, a hardware state that ``syncwatch_gpu_up`` says and SyncwatchGpuLost pages for. It
  was ``NoData``: every GPU series vanished, the remembered ones too, and SyncwatchGpuLost never
  fired while every job on the node was dead.
* An init error once the daemon has read GPUs is the collector error it is (success 0, above),
  and what its GPUs read depends on whose fault it is:

  - the driver's or the GPUs' (``UNKNOWN``, ``IRQ_ISSUE``, ``INSUFFICIENT_RESOURCES``, any code
    not listed next): the same ``syncwatch_gpu_up 0`` for every GPU it remembers, with the same
    one warning: no GPU of the node is watched, and none lost meanwhile could page otherwise;
  - the daemon's own deployment (``NO_PERMISSION``: ``/dev/nvidiactl`` no longer granted to it;
    ``LIB_RM_VERSION_MISMATCH``: its library is the old driver's; ``FUNCTION_NOT_FOUND``), the
    GPUs most likely fine: no GPU series (its XIDs counted before stay), not up 0, which would
    page SyncwatchGpuLost, critical, for every GPU of the node.

  Either way the GPU series are not the last snapshot's: an init error raised served it (every
  GPU up 1) until stale (17 s), then withdrew every GPU series, the remembered ones too.
* A GPU that is lost (``GPU_IS_LOST``), needs a reset (``RESET_REQUIRED``) or times out
  (``TIMEOUT``) reports ``syncwatch_gpu_up 0`` and none of its values (withdrawn, not frozen);
  the other GPUs keep reporting.
* A GPU the daemon may not open (``NO_PERMISSION`` for its handle: its device file is not granted
  to the daemon) is a collector error and reports nothing, not ``syncwatch_gpu_up 0``: its GPU is
  not lost, and SyncwatchGpuLost would page for it.
* A GPU gone from the enumeration: when ``nvmlDeviceGetCount`` fails (a driver reset) NVML is
  closed and initialized again, and every UUID read anew (indices are NVML's of this
  initialization). A GPU that fell off the bus may then be listed no more: the count is lower and
  the GPUs after it move down one index. The collector remembers every GPU it has read since the
  daemon started (UUID -> last index, bounded by the GPUs the node ever had). For one that no
  index answers with in a cycle, NVML is asked for its UUID (``nvmlDeviceGetHandleByUUID``):
  ``NOT_FOUND`` (gone), or ``GPU_IS_LOST`` and any other failure (down), reports
  ``syncwatch_gpu_up{gpu=<its last index>, uuid} 0`` and none of its values, with one warning
  when it goes missing, until NVML lists it again (then it is up under whatever index it has);
  without this its series vanished, SyncwatchGpuLost with them. ``NO_PERMISSION`` (there, not
  watchable) reports nothing and is a collector error, as below; a handle (there, at an index
  that answered no UUID) reports nothing more than that index. Its last index may now be another
  GPU's: the two series differ by ``uuid``. A GPU enumerated but down before its UUID was read
  (``uuid=""``) may be the missing one or another: both read 0. While indices answer
  NO_PERMISSION that no missing GPU is placed at (NVML documents no NO_PERMISSION for the UUID
  call: a library may answer NOT_FOUND for a GPU it may not open), a missing GPU may be at one
  of them, healthy, and is not reported down (the collector error says so). XIDs counted before
  stay as they are. A GPU whose UUID was never read is not remembered: if it leaves the list,
  its ``uuid=""`` series goes too. A remembered GPU read under a new index (renumbered) takes the
  XIDs counted for it along: one series per GPU and XID, under the index it has now.
* ``NOT_SUPPORTED`` means that one metric is absent for that GPU, and ``FUNCTION_NOT_FOUND`` (the
  driver predates the call) that it is absent on this node; the clock-event reasons then come
  from the older name of the same call. Any other NVML error drops that metric and is reported as
  a collector error.
* XID errors come from an NVML event set drained without waiting (timeout 0) each cycle and are
  counted per GPU and XID, with the wall-clock time of the latest of each. NVML's event data
  (``c_nvmlEventData_t``) carries no time: it is when the daemon drained the event, normally
  within one collector interval. The alerts use that time, not the counter: a counter restarts
  at 0 with the daemon and its series only appears at the first XID, so ``increase()`` missed
  an XID soon after Prometheus first scraped a daemon, and one that recurred after a restart.
  While a GPU in the event set is lost, NVML answers every wait with ``GPU_IS_LOST`` and gives no
  event of any GPU: the set is then made anew without the GPUs that are down (a warning names
  them), the other GPUs' XIDs are read on, those already counted stay exported, and a GPU that
  answers again is registered again. A cycle without an event set (``nvmlEventSetCreate``
  failed) is an error, and the set is made again the next cycle.
* A GPU whose UUID was never read (down since NVML was initialized) is exported with uuid "";
  the UUID is asked for again every cycle, and once read its series, and the XIDs counted under
  "" meanwhile, carry it.

A call that hangs inside the driver is handled by the runner (one worker, per-call timeout).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .base import CollectorOptions, NoData, register

# NVML clock-event reason bit -> reason label. "thermal" (below) is sw_thermal or hw_thermal.
THROTTLE_REASONS = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle"),
    ("applications_clocks", "nvmlClocksEventReasonApplicationsClocksSetting"),
    ("power_cap", "nvmlClocksEventReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost"),
    ("sw_thermal", "nvmlClocksEventReasonSwThermalSlowdown"),
    ("hw_thermal", "nvmlClocksEventReasonHwThermalSlowdown"),
    ("power_brake", "nvmlClocksEventReasonHwPowerBrakeSlowdown"),
    ("display_clock", "nvmlClocksEventReasonDisplayClockSetting"),
)
# NVML field value type -> member of pynvml's ``c_nvmlValue_t`` union. nvidia-ml-py 12.535.x
# (which pyproject allows) has no NVML_VALUE_TYPE_UNSIGNED_SHORT, and 12.560.30 has it without the
# union's ``usVal``: a value of a type the installed library cannot read is absent. Looked up
# unguarded, the missing constant failed every cycle: no GPU series at all.
VALUE_MEMBERS = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)
MAX_EVENTS_PER_CYCLE = 256
log = logging.getLogger("syncwatch.collectors.gpu")


class _GpuDown(Exception):
    pass


class _GpuForbidden(Exception):
    """NVML may not open this GPU for the daemon (``NO_PERMISSION``): a deployment fault of ours,
    not a hardware state. ``syncwatch_gpu_up 0`` would page SyncwatchGpuLost for a healthy GPU."""


class _DaemonFault(RuntimeError):
    """nvmlInit failed for a fault of the daemon's own deployment (its device access, its NVML
    library), not of the driver or the GPUs, which are most likely fine: its GPUs do not read
    ``syncwatch_gpu_up 0``, which would page SyncwatchGpuLost for every GPU of the node."""


class GpuCollector:
    def __init__(self, nvml=None, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 backoff: tuple[float, float] = (10.0, 300.0)):
        if nvml is None:
            import pynvml as nvml
        self.nvml = nvml
        self.clock = clock
        self.wall_clock = wall_clock
        self._backoff_min, self._backoff_max = backoff
        self._backoff = self._backoff_min
        self._retry_at = 0.0
        self._init_failure: Exception | None = None
        self._ready = False
        self._events = None
        self._uuids: dict[int, str] = {}  # NVML index -> UUID, for this initialization only
        self._xids: Counter[tuple[int, str, int]] = Counter()  # (index, uuid, xid) -> events
        # (index, xid) of this initialization counted under uuid "": its UUID not read yet
        self._xid_no_uuid: set[tuple[int, int]] = set()
        self._xid_last: dict[tuple[int, str, int], float] = {}  # ... -> wall time of the latest
        self._down_gpus: set[int] = set()
        # UUID -> NVML index it had when last read, of every GPU seen since the daemon started: not
        # cleared by close(), it tells a GPU gone from the enumeration from one the node never had.
        # Bounded by the GPUs the node ever had.
        self._known: dict[str, int] = {}
        self._missing: set[str] = set()  # known UUIDs no index answers with, warned about once
        # nvmlInit absent or failing (but for a _DaemonFault) after GPUs were read: warned about
        # once, re-armed by the first count that succeeds after it
        self._gone_warned = False
        self._xid_unwatched: set[int] = set()  # down GPUs left out of the event set, until they answer
        self._throttle_reasons_call = False  # the driver predates nvmlDeviceGetCurrentClocksEventReasons
        nv = nvml
        self._down = {nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_RESET_REQUIRED, nv.NVML_ERROR_TIMEOUT}
        # FUNCTION_NOT_FOUND from nvmlInit is no absence: the library is there, too old for the
        # init call (a driver an operator must see), and counted as absent it was silent, success 1
        # GPU_NOT_FOUND ("No GPUs were found"): pynvml's nvmlInit passes flags 0, without
        # NVML_INIT_FLAG_NO_GPUS, so init fails on a node with a driver and no GPU, or whose last
        # GPU left the bus. getattr: a constant an older nvidia-ml-py may lack.
        self._no_gpu = getattr(nv, "NVML_ERROR_GPU_NOT_FOUND", None)
        self._absent = {c for c in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED,
                                    self._no_gpu) if c is not None}
        self._rm_mismatch = getattr(nv, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", None)
        self._daemon_faults = {c for c in (nv.NVML_ERROR_NO_PERMISSION, nv.NVML_ERROR_FUNCTION_NOT_FOUND,
                                           self._rm_mismatch) if c is not None}
        self._reasons = [(label, getattr(nv, const)) for label, const in THROTTLE_REASONS]
        self._thermal = nv.nvmlClocksEventReasonSwThermalSlowdown | nv.nvmlClocksEventReasonHwThermalSlowdown
        self._value_members = {getattr(nv, name): member for name, member in VALUE_MEMBERS
                               if hasattr(nv, name)}

    # --- NVML lifecycle -------------------------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        now = self.clock()
        if now < self._retry_at:  # fresh exceptions: re-raising one instance grows its traceback
            if isinstance(self._init_failure, NoData):
                raise NoData(str(self._init_failure))
            raise type(self._init_failure)(f"NVML unavailable ({self._init_failure}); "
                                           f"retry in {self._retry_at - now:.0f}s")
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)
            if e.value in self._absent:
                what = "NVML finds no GPU" if e.value == self._no_gpu else "NVML absent"
                self._init_failure = NoData(f"{what}: {e}")
                raise self._init_failure from None
            reason = str(e)
            if e.value == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                reason += (": the node's NVML library (libnvidia-ml, from the driver) lacks the init "
                           "call nvidia-ml-py makes: a driver older than this nvidia-ml-py supports")
            elif e.value == self._rm_mismatch:
                reason += (": the driver was reloaded at another version (an upgrade) under this "
                           "daemon, whose NVML library, loaded once per process, is the old one; "
                           "no GPU is watched until you restart the daemon")
            failure = _DaemonFault if e.value in self._daemon_faults else RuntimeError
            self._init_failure = failure(reason)
            raise failure(f"nvmlInit failed: {reason}") from None
        self._ready = True
        self._backoff = self._backoff_min
        self._init_failure = None
        self._events = None  # made by the first cycle, once it has the count

    def _register_xids(self, events, indices) -> None:
        """Register each GPU of ``indices`` for XID events in ``events``. One that is down (lost,
        needing a reset) is kept in ``_xid_unwatched`` and registered again once it answers; one
        whose XIDs are unsupported is not counted."""
        nv = self.nvml
        for i in indices:
            try:
                nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i),
                                            nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError as e:
                if e.value in self._down:
                    self._xid_unwatched.add(i)
                    continue
            self._xid_unwatched.discard(i)

    def close(self) -> None:
        if not self._ready:
            return
        nv = self.nvml
        self._ready = False
        # A GPU gone when NVML comes back (fell off the bus, driver reloaded) shifts the indices
        # of those after it: UUIDs cached by index put each one's values under its neighbour's
        # UUID, the lost GPU's included.
        self._uuids.clear()
        self._down_gpus.clear()
        self._xid_unwatched.clear()
        self._xid_no_uuid.clear()  # the index may be another GPU's after NVML comes back
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self._events = None

    # --- one cycle ----------------------------------------------------------------------------

    def update(self, errors: list[str]):
        try:
            self._ensure_ready()
        except NoData as e:
            if not self._known:
                raise  # a node where this daemon never read a GPU: no GPUs, quietly
            return self._nvml_gone(e)
        except _DaemonFault as e:
            # No GPU series, not up 0 (see _DaemonFault). Returned, not raised: raised, the runner
            # served the last snapshot, every GPU up 1, for 17 s after NVML stopped answering
            errors.append(str(e))
            return self._xid_families()
        except RuntimeError as e:
            if not self._known:
                raise
            errors.append(str(e))  # an error still, as on a node where no GPU was read
            return self._nvml_gone(e)
        nv = self.nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            self.close()  # re-initialize next cycle
            raise RuntimeError(f"nvmlDeviceGetCount failed: {e}") from None
        if self._gone_warned:
            # re-armed by a count, not by the init: NVML flapping (init succeeds, the count fails,
            # the next init answers DRIVER_NOT_LOADED) logged this and the warning every retry
            self._gone_warned = False
            log.info("NVML answers again: the GPUs it lists read up (those it no longer lists "
                     "read syncwatch_gpu_up 0)")

        gu = ["gpu", "uuid"]
        up = _up_family()
        gauges = {
            "temperature": GaugeMetricFamily("syncwatch_gpu_temperature_celsius", "GPU core temperature.", labels=gu),
            "memory_temperature": GaugeMetricFamily("syncwatch_gpu_memory_temperature_celsius",
                                                    "GPU memory (HBM) temperature.", labels=gu),
            "power": GaugeMetricFamily("syncwatch_gpu_power_watts", "GPU power draw.", labels=gu),
            "sm_clock": GaugeMetricFamily("syncwatch_gpu_sm_clock_hertz", "Current SM clock.", labels=gu),
            "utilization": GaugeMetricFamily("syncwatch_gpu_utilization_ratio",
                                             "Share of the last sample period a kernel was running.", labels=gu),
        }
        energy = CounterMetricFamily("syncwatch_gpu_energy_joules", "Energy consumed since the driver loaded.",
                                     labels=gu)
        throttle = GaugeMetricFamily("syncwatch_gpu_throttle_active",
                                     "1 while the clock-event (throttle) reason is active. 'thermal' is "
                                     "sw_thermal or hw_thermal: aggregate with max, not sum.",
                                     labels=[*gu, "reason"])
        ecc = CounterMetricFamily("syncwatch_gpu_ecc_errors", "Volatile ECC errors by type.",
                                  labels=[*gu, "type"])
        replays = CounterMetricFamily("syncwatch_gpu_pcie_replays", "PCIe replays.", labels=gu)

        forbidden: set[int] = set()
        for i in range(count):
            try:
                uuid, values = self._read_gpu(i, errors)
            except _GpuForbidden as e:
                errors.append(f"gpu {i} not watched: {e} (the daemon needs read access to every "
                              "GPU device file, /dev/nvidia*)")
                forbidden.add(i)
                continue
            except _GpuDown as e:
                # A hardware state, not a collector failure: syncwatch_gpu_up says it.
                up.add_metric([str(i), self._uuids.get(i, "")], 0)
                if i not in self._down_gpus:
                    log.warning("gpu %d (%s) is down: %s", i, self._uuids.get(i, "?"), e)
                    self._down_gpus.add(i)
                continue
            self._down_gpus.discard(i)
            labels = [str(i), uuid]
            up.add_metric(labels, 1)
            for key, fam in gauges.items():
                if values.get(key) is not None:
                    fam.add_metric(labels, values[key])
            if values.get("energy") is not None:
                energy.add_metric(labels, values["energy"])
            mask = values.get("reasons")
            if mask is not None:
                for label, bit in self._reasons:
                    throttle.add_metric([*labels, label], 1 if mask & bit else 0)
                throttle.add_metric([*labels, "thermal"], 1 if mask & self._thermal else 0)
            for kind in ("corrected", "uncorrected"):
                if values.get(kind) is not None:
                    ecc.add_metric([*labels, kind], values[kind])
            if values.get("replays") is not None:
                replays.add_metric(labels, values["replays"])
        self._export_missing(up, count, forbidden, errors)

        if self._events is None:
            self._make_events(count, errors)
        elif self._xid_unwatched - self._down_gpus:
            self._register_xids(self._events, sorted(self._xid_unwatched - self._down_gpus))
        self._drain_xids(count, errors)
        self._label_xids()
        return [up, *gauges.values(), energy, throttle, ecc, replays, *self._xid_families()]

    def _xid_families(self) -> list:
        """The XIDs counted since the daemon started, and when the latest of each arrived."""
        labels = ["gpu", "uuid", "xid"]
        xids = CounterMetricFamily("syncwatch_gpu_xid_errors", "XID critical errors reported by the driver.",
                                   labels=labels)
        xid_last = GaugeMetricFamily("syncwatch_gpu_xid_last_event_timestamp_seconds",
                                     "Wall-clock time the daemon received the latest XID critical "
                                     "error of this code from the driver (Unix seconds).",
                                     labels=labels)
        for (i, uuid, xid), n in sorted(self._xids.items()):
            xids.add_metric([str(i), uuid, str(xid)], n)
            xid_last.add_metric([str(i), uuid, str(xid)], self._xid_last[(i, uuid, xid)])
        return [xids, xid_last]

    def _known_by_index(self) -> list[tuple[str, int]]:
        """The GPUs read since the daemon started, (uuid, last index), by index then uuid."""
        return sorted(self._known.items(), key=lambda item: (item[1], item[0]))

    def _nvml_gone(self, why: Exception) -> list:
        """NVML absent (``DRIVER_NOT_LOADED``; ``LIBRARY_NOT_FOUND``, which pynvml cannot answer
        once it has loaded the library, handled the same, defensively) or finding no GPU
        (``GPU_NOT_FOUND``) on a node whose GPUs this daemon has read: the driver unloaded (a
        reset it did not come back from), or every GPU left the bus (a single-GPU node whose GPU
        fell off). That is no node without GPUs but a failure of all of them: it read as NoData
        (GPU_NOT_FOUND: an init error, the last snapshot served until 17 s old, then every GPU
        series withdrawn), the remembered ones too, and SyncwatchGpuLost never
        fired while every job on the node was dead. Each GPU seen since the daemon started reads
        ``syncwatch_gpu_up{gpu=<its last index>, uuid} 0`` and none of its values (its XIDs
        counted before stay), with one warning (re-armed once a count succeeds: not by an init
        whose count then fails), until NVML initializes again (retried with the backoff). Not a
        collector error, as for a GPU lost: a hardware state, said by gpu_up.

        An init error on such a node (``UNKNOWN``, ``IRQ_ISSUE``, ...) reads the same, and
        ``update`` reports it as the collector error it is: raised, it served the last snapshot
        (up 1) until stale (17 s), then no GPU series at all. Not a ``_DaemonFault``: its GPUs
        are most likely fine, and ``update`` withdraws their series instead."""
        up = _up_family()
        known = self._known_by_index()
        for uuid, i in known:
            up.add_metric([str(i), uuid], 0)
        if not self._gone_warned:
            self._gone_warned = True
            log.warning("%s on a node whose GPUs this daemon has read: none of its GPUs answers "
                        "NVML; gpu %s read syncwatch_gpu_up 0 under their last index until NVML "
                        "answers again (init retried with backoff, at most %gs apart)", why,
                        ", ".join(f"{i} ({uuid})" for uuid, i in known), self._backoff_max)
        return [up, *self._xid_families()]

    def _export_missing(self, up: GaugeMetricFamily, count: int, forbidden: set[int],
                        errors: list[str]) -> None:
        """``syncwatch_gpu_up 0`` under its last index for each GPU seen since the daemon started
        that no index answers with this cycle and NVML does not find, or finds down. NVML
        initialized again (after a driver reset) may no longer enumerate a GPU that fell off the
        bus: nvmlDeviceGetCount is lower, its UUID at no index, and its series, up 0 included,
        vanished: SyncwatchGpuLost resolved, or never fired, just when the GPU was most lost.

        Whether such a GPU is gone is NVML's answer to its UUID (nvmlDeviceGetHandleByUUID, asked
        only for the remembered UUIDs no index answered with): ``NOT_FOUND``, gone;
        ``GPU_IS_LOST`` and any other failure, down (NVML answers GPU_IS_LOST while any GPU it
        lists is lost); ``NO_PERMISSION``, there but not watchable (a collector error, no page);
        a handle, there (its index answered no UUID this cycle: that index's series says what
        it is). It was told by the GPU's last index, skipped when that index answered
        NO_PERMISSION: after the renumbering that index is another GPU's, so a gone GPU whose
        last index was forbidden reported nothing, and a healthy GPU now at a forbidden index
        read 0 under its last one: paged.

        NVML documents no NO_PERMISSION for that call: a library may answer NOT_FOUND for a GPU
        the daemon may not open. While fewer remembered GPUs answered NO_PERMISSION than indices
        did, a GPU not found (or found down) may sit at a forbidden index, healthy: it is then
        not reported down, and the collector error says so.

        The last index may now be another GPU's (those after it move down): the label sets differ
        by ``uuid``. A GPU enumerated but down before its UUID was read (``uuid=""``) may be the
        missing one or not: both read 0, both true."""
        seen = {uuid: i for i, uuid in self._uuids.items() if i < count}
        for uuid, i in seen.items():
            if uuid in self._missing:
                self._missing.discard(uuid)
                log.info("gpu %d (%s) is enumerated again (it was gpu %d before it went)",
                         i, uuid, self._known[uuid])
            if self._known.get(uuid, i) != i:
                self._move_xids(uuid, i)
            self._known[uuid] = i
        unseen = [(uuid, i) for uuid, i in self._known_by_index() if uuid not in seen]
        if not unseen:
            return
        nv = self.nvml
        down: list[tuple[str, int, Exception]] = []
        placed = 0  # remembered GPUs NVML says the daemon may not open: each at a forbidden index
        for uuid, i in unseen:
            try:
                nv.nvmlDeviceGetHandleByUUID(uuid)
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_NO_PERMISSION:
                    placed += 1
                    errors.append(f"{uuid} (gpu {i} when last read) not watched: "
                                  f"nvmlDeviceGetHandleByUUID: {e}")
                else:
                    down.append((uuid, i, e))
                continue
            # NVML has it, at an index that answered no UUID this cycle: that index says what it is
        if down and len(forbidden) > placed:
            errors.append("not reported down, as gpu " + ", ".join(map(str, sorted(forbidden)))
                          + " may not be opened and may be any of them: "
                          + ", ".join(f"{uuid} (gpu {i} when last read, "
                                      f"nvmlDeviceGetHandleByUUID: {e})" for uuid, i, e in down))
            return
        for uuid, i, e in down:
            up.add_metric([str(i), uuid], 0)
            if uuid not in self._missing:
                self._missing.add(uuid)
                if e.value == nv.NVML_ERROR_NOT_FOUND:
                    state = f"no longer enumerated: NVML finds no GPU with its UUID ({e})"
                else:
                    state = (f"down: no index read this cycle answers with its UUID, and NVML "
                             f"asked for it answers {e}")
                log.warning("gpu %d (%s) is %s; it reads syncwatch_gpu_up 0 under gpu %d until "
                            "NVML lists it again", i, uuid, state, i)

    def _read_gpu(self, i: int, errors: list[str]):
        nv = self.nvml

        def call(what, fn, *args):
            try:
                return fn(*args)
            except nv.NVMLError as e:
                if e.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                    return None
                if e.value in self._down:
                    raise _GpuDown(f"{what}: {e}") from None
                errors.append(f"gpu {i} {what}: {e}")
                return None

        try:
            handle = nv.nvmlDeviceGetHandleByIndex(i)
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_NO_PERMISSION:
                raise _GpuForbidden(f"nvmlDeviceGetHandleByIndex: {e}") from None
            raise _GpuDown(f"nvmlDeviceGetHandleByIndex: {e}") from None
        uuid = self._uuids.get(i)
        if uuid is None:
            uuid = call("uuid", nv.nvmlDeviceGetUUID, handle)
            if uuid is None:
                raise _GpuDown("no UUID")
            self._uuids[i] = uuid
        v: dict[str, float | int | None] = {}
        v["temperature"] = call("temperature", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        v["memory_temperature"] = self._field(call, handle, nv.NVML_FI_DEV_MEMORY_TEMP)
        mw = call("power", nv.nvmlDeviceGetPowerUsage, handle)
        v["power"] = None if mw is None else mw / 1000
        mj = call("energy", nv.nvmlDeviceGetTotalEnergyConsumption, handle)
        v["energy"] = None if mj is None else mj / 1000
        mhz = call("sm clock", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
        v["sm_clock"] = None if mhz is None else mhz * 1_000_000
        util = call("utilization", nv.nvmlDeviceGetUtilizationRates, handle)
        v["utilization"] = None if util is None else util.gpu / 100
        v["reasons"] = call("clock event reasons", self._clock_event_reasons, handle)
        v["corrected"] = call("ecc", nv.nvmlDeviceGetTotalEccErrors, handle,
                              nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        v["uncorrected"] = call("ecc", nv.nvmlDeviceGetTotalEccErrors, handle,
                                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        v["replays"] = call("pcie replays", nv.nvmlDeviceGetPcieReplayCounter, handle)
        return uuid, v

    def _clock_event_reasons(self, handle) -> int:
        """The clock-event (throttle) reason mask. Drivers before R535 lack
        nvmlDeviceGetCurrentClocksEventReasons (pynvml raises FUNCTION_NOT_FOUND): every cycle
        failed and no throttle series was exported on those nodes. The deprecated
        nvmlDeviceGetCurrentClocksThrottleReasons returns the same bit mask."""
        nv = self.nvml
        if not self._throttle_reasons_call:
            try:
                return nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_FUNCTION_NOT_FOUND or not hasattr(
                        nv, "nvmlDeviceGetCurrentClocksThrottleReasons"):
                    raise
                self._throttle_reasons_call = True
        return nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    def _field(self, call, handle, field_id):
        """One NVML field value; a per-field return code is treated like a call's error."""
        nv = self.nvml
        values = call("field values", nv.nvmlDeviceGetFieldValues, handle, [field_id])
        if values is None:
            return None
        fv = values[0]
        if fv.nvmlReturn != nv.NVML_SUCCESS:
            return call(f"field {field_id}", _raise, nv.NVMLError(fv.nvmlReturn))
        member = self._value_members.get(fv.valueType)
        return None if member is None else getattr(fv.value, member, None)

    def _drain_xids(self, count: int, errors: list[str]) -> None:
        """Count pending XID events and note when each arrived, without waiting (timeout 0 answers
        NVML_ERROR_TIMEOUT when empty).

        While a GPU registered in the event set is lost, every wait answers GPU_IS_LOST, without
        saying which GPU, and no event of any GPU comes out of that set: every cycle failed and
        the other GPUs' XIDs went unread. The set is then made anew without the GPUs that are
        down (those this cycle found down, and those NVML refuses to register)."""
        nv = self.nvml
        if self._events is None:
            return
        remade = False
        for _ in range(MAX_EVENTS_PER_CYCLE):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_GPU_IS_LOST and not remade:
                    remade = True
                    self._remake_events(count, errors)
                    if self._events is not None:
                        continue
                elif e.value != nv.NVML_ERROR_TIMEOUT:
                    errors.append(f"xid events: {e}")
                return
            if data.eventType != nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                continue
            key = (index, self._uuids.get(index, ""), int(data.eventData))
            if not key[1]:
                self._xid_no_uuid.add((index, key[2]))
            self._xids[key] += 1
            self._xid_last[key] = self.wall_clock()

    def _move_xids(self, uuid: str, index: int) -> None:
        """The XIDs counted for GPU ``uuid`` under another index, moved to ``index``, the one NVML
        gives it now (renumbered after a GPU before it left the list). Keyed by (index, uuid,
        xid), they stayed under the old index and a new XID of the GPU started a second series:
        SyncwatchGpuXidCritical fired twice for one GPU, and a dashboard summing by node and
        ``gpu`` added them to the GPU now at the old index."""
        for key in [k for k in self._xids if k[1] == uuid and k[0] != index]:
            new = (index, uuid, key[2])
            self._xids[new] += self._xids.pop(key)
            self._xid_last[new] = max(self._xid_last.pop(key), self._xid_last.get(new, 0.0))

    def _label_xids(self) -> None:
        """Move the XIDs counted under uuid "" (the GPU registered, its UUID not read: it timed
        out) to its UUID once a cycle read it. They stayed under "" for good: series that no
        ``syncwatch_rank_info`` joins."""
        for index, xid in [k for k in self._xid_no_uuid if k[0] in self._uuids]:
            self._xid_no_uuid.discard((index, xid))
            old, new = (index, "", xid), (index, self._uuids[index], xid)
            self._xids[new] += self._xids.pop(old)
            self._xid_last[new] = max(self._xid_last.pop(old), self._xid_last.get(new, 0.0))

    def _make_events(self, count: int, errors: list[str], skip: set[int] = frozenset()) -> None:
        """The XID event set, registered for every GPU but those of ``skip`` (left in
        ``_xid_unwatched``): made in the first cycle of an initialization, and again in every
        cycle after one where it could not be made, an error each time (no XID is read without
        it). Made in ``_ensure_ready``, a count failing after it left it unfreed, and a failure
        there or in ``_remake_events`` left the collector without a set, no XID read and no
        error, until NVML was initialized again."""
        nv = self.nvml
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            errors.append(f"xid events: nvmlEventSetCreate failed, no XID is read: {e} "
                          "(retried next cycle)")
            return
        self._xid_unwatched |= skip
        self._register_xids(events, [i for i in range(count) if i not in skip])
        self._events = events

    def _remake_events(self, count: int, errors: list[str]) -> None:
        nv = self.nvml
        try:
            nv.nvmlEventSetFree(self._events)
        except nv.NVMLError:
            pass
        self._events = None
        self._make_events(count, errors, skip=self._down_gpus)
        if self._events is not None and self._xid_unwatched:
            log.warning("xid events: a GPU is lost (nvmlEventSetWait_v2 answers GPU_IS_LOST); the XIDs "
                        "of gpu %s are not read until it answers again, those of the other GPUs are",
                        ", ".join(f"{i} ({self._uuids.get(i, '?')})" for i in sorted(self._xid_unwatched)))


def _raise(e: Exception):
    raise e


def _up_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("syncwatch_gpu_up", "1 while the GPU answers NVML, 0 when lost, timed "
                             "out or needing a reset, and 0 under its last index for a GPU seen "
                             "since the daemon started that NVML no longer lists (or while NVML "
                             "fails to initialize, unless for a fault of the daemon's own, which "
                             "withdraws the series).", labels=["gpu", "uuid"])


@register("gpu", default=True, help="NVIDIA GPUs through NVML (temperatures, power, clocks, throttling, errors)")
def _make(options: CollectorOptions) -> GpuCollector:
    return GpuCollector()
