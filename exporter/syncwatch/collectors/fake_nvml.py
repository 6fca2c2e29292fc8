"""A fake NVML for machines without GPUs: tests, benchmarks and simulated demos.

It has pynvml's real function names, argument order, return types (ctypes structures such as
``c_nvmlUtilization_t``, ``c_nvmlFieldValue_t``, ``c_nvmlEventData_t``, device handles of type
``c_nvmlDevice_t``) and raises pynvml's own ``NVMLError`` subclasses (``pynvml.NVMLError(code)``
builds the matching one), so ``GpuCollector(nvml=FakeNvml(...))`` runs exactly the code paths it
runs against the real library. Constants (``NVML_*``, ``nvmlClocksEventReason*``, ...) and error
classes are pynvml's, looked up on the real module; a function the fake does not implement is an
``AttributeError``, never a silent call into the real library.

It lives in the package rather than under tests/ so the simulator can feed it (``FakeGpu`` fields
are plain attributes a simulation may change between cycles, e.g. temperature and throttle reasons
for a thermal-drift scenario). ``fall_off_bus`` loses a GPU the way NVML does: its calls answer
GPU_IS_LOST, and once the driver is reloaded NVML lists it no more (the count one lower, the GPUs
after it renumbered); ``enumerate_at_next_init`` lists it again. With the real library a plain
``nvmlShutdown`` and ``nvmlInit``, the driver loaded, still lists a lost GPU, as lost: it leaves
the list with the driver reload. The fake does not tell the two apart: it enumerates anew at the
first ``nvmlInit`` after ``initialized`` fell to 0, and tests stand for the reload by setting
``initialized = 0``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    temperature: int = 45              # celsius
    memory_temperature: int | None = 50  # None: NOT_SUPPORTED (consumer boards)
    power_mw: int = 350_000
    energy_mj: int = 1_000_000_000
    sm_clock_mhz: int = 1980
    utilization: int = 95              # percent
    reasons: int = 0                   # clock-event reason bit mask
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    pcie_replays: int = 0
    error: int | None = None           # NVML error code every call on this GPU raises (e.g. GPU_IS_LOST)
    not_supported: set[str] = field(default_factory=set)  # function names answering NOT_SUPPORTED


def healthy_node(n: int = 8) -> list[FakeGpu]:
    """``n`` healthy GPUs with stable, distinct UUIDs and slightly different readings."""
    return [FakeGpu(uuid=f"GPU-{i:08x}-1111-2222-3333-44445555{i:04x}", temperature=40 + i,
                    power_mw=300_000 + 1000 * i, energy_mj=1_000_000_000 + 1_000_000 * i)
            for i in range(n)]


class FakeNvml:
    """Stands in for the ``pynvml`` module."""

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None,
                 driver_lacks: set[str] = frozenset(), library_lacks: set[str] = frozenset()):
        self.gpus = healthy_node() if gpus is None else gpus
        self.init_error = init_error  # e.g. NVML_ERROR_DRIVER_NOT_LOADED
        # functions an older driver's library lacks: pynvml raises FUNCTION_NOT_FOUND for them
        self.driver_lacks = set(driver_lacks)
        # names an older nvidia-ml-py module lacks (e.g. NVML_VALUE_TYPE_UNSIGNED_SHORT before
        # 12.560): looking them up raises AttributeError, as on that module
        self.library_lacks = set(library_lacks)
        self.initialized = 0
        self.calls = 0
        self._structs = [pynvml.struct_c_nvmlDevice_t() for _ in self.gpus]
        self._next_gpus: list[FakeGpu] | None = None  # what the next first nvmlInit enumerates
        # event set (address of its struct) -> [the struct, GPU indices registered, (gpu, xid) pending]
        self._sets: dict[int, tuple[object, set[int], list[tuple[int, int]]]] = {}
        self._hang: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    # --- test controls --------------------------------------------------------------------------

    def hang(self, function: str) -> threading.Event:
        """Make every call of ``function`` block until the returned event is set (a GPU in D-state)."""
        gate = threading.Event()
        self._hang[function] = gate
        return gate

    def unhang(self) -> None:
        for gate in self._hang.values():
            gate.set()
        self._hang.clear()

    def fall_off_bus(self, index: int) -> FakeGpu:
        """GPU ``index`` falls off the bus, as NVML sees it: from now on every call on it answers
        GPU_IS_LOST while it keeps its index and nvmlDeviceGetCount counts it, and once the driver
        is reloaded it is no longer enumerated: nvmlDeviceGetCount one lower, the GPUs after it one
        index down. (Real NVML initialized again without a reload still lists it, as lost; the
        fake enumerates anew at the first nvmlInit after ``initialized`` fell to 0, which tests
        set to stand for the reload.) Returns the GPU (``enumerate_at_next_init`` brings it back)."""
        gpu = self.gpus[index]
        gpu.error = pynvml.NVML_ERROR_GPU_IS_LOST
        pending = self.gpus if self._next_gpus is None else self._next_gpus
        self._next_gpus = [g for g in pending if g is not gpu]
        return gpu

    def enumerate_at_next_init(self, gpus: list[FakeGpu]) -> None:
        """The GPUs, in index order, that NVML enumerates once initialized again after a driver
        reload (a GPU back on the bus after a reset or reseat, in whatever place): in the fake, at
        the first nvmlInit after ``initialized`` fell to 0."""
        self._next_gpus = list(gpus)

    def _enumerate(self, gpus: list[FakeGpu]) -> None:
        """Number ``gpus`` 0, 1, ... as a fresh NVML initialization does. A GPU enumerated before
        keeps its device struct (its handle now answers its new index); the event sets made
        before are gone, as after a driver reload."""
        structs = {id(g): s for g, s in zip(self.gpus, self._structs)}
        self._structs = [structs[id(g)] if id(g) in structs else pynvml.struct_c_nvmlDevice_t()
                         for g in gpus]
        self.gpus[:] = gpus
        with self._lock:
            self._sets.clear()

    def xid(self, gpu: int, xid: int) -> None:
        """Queue an XID critical-error event for ``gpu`` in every event set it is registered in."""
        with self._lock:
            for _, registered, pending in self._sets.values():
                if gpu in registered:
                    pending.append((gpu, xid))

    def watching(self, gpu: int) -> bool:
        """Whether an event set is registered for ``gpu``: an XID queued before gets lost, as with
        NVML, which delivers no event that came before the registration."""
        with self._lock:
            return any(gpu in registered for _, registered, _ in self._sets.values())

    # --- module attributes ----------------------------------------------------------------------

    def __getattr__(self, name: str):
        if name in self.__dict__.get("library_lacks", ()):
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
        value = getattr(pynvml, name)  # AttributeError for unknown names, like the module
        if callable(value) and not isinstance(value, type):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return value

    def _enter(self, function: str, handle=None) -> FakeGpu | None:
        self.calls += 1
        gate = self._hang.get(function)
        if gate is not None:
            gate.wait()
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if function in self.driver_lacks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if handle is None:
            return None
        gpu = self.gpus[self._index(handle)]
        if gpu.error is not None:
            raise pynvml.NVMLError(gpu.error)
        if function in gpu.not_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _index(self, handle) -> int:
        address = ctypes.addressof(handle.contents)
        for i, s in enumerate(self._structs):
            if ctypes.addressof(s) == address:
                return i
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    # --- pynvml functions -----------------------------------------------------------------------

    def nvmlInit(self):
        self.calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        if not self.initialized and self._next_gpus is not None:
            self._enumerate(self._next_gpus)
            self._next_gpus = None
        self.initialized += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].error is not None:
            raise pynvml.NVMLError(self.gpus[index].error)
        return pynvml.c_nvmlDevice_t(self._structs[index])

    def nvmlDeviceGetHandleByUUID(self, uuid):
        """pynvml's ``nvmlDeviceGetHandleByUUID(uuid)``: the UUID as ``str`` (pynvml encodes it for
        the C call) or ``bytes``. NVML searches the GPUs it lists, initializing them as it goes.
        The codes are those NVML documents for the call: the handle of the GPU listed with that
        UUID, ``NOT_FOUND`` when no listed GPU has it, ``GPU_IS_LOST`` while a GPU met in the
        search "has fallen off the bus or is otherwise inaccessible" (a lost GPU before it in
        index order, or any lost GPU when it is not found). The GPU found answers its own error
        (as every call on it does): for ``NO_PERMISSION``, which NVML documents for
        nvmlDeviceGetHandleByIndex but not for this call, that is an assumption (a real library
        may answer ``NOT_FOUND`` for a GPU it may not open; the collector copes with both)."""
        self._enter("nvmlDeviceGetHandleByUUID")
        if isinstance(uuid, bytes):
            uuid = uuid.decode()
        if not isinstance(uuid, str):
            raise TypeError(f"uuid must be str or bytes, not {type(uuid).__name__}")  # ctypes' c_char_p
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                if gpu.error is not None:
                    raise pynvml.NVMLError(gpu.error)
                return pynvml.c_nvmlDevice_t(self._structs[index])
            if gpu.error == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle):
        self._enter("nvmlDeviceGetIndex")
        return self._index(handle)

    def nvmlDeviceGetUUID(self, handle):
        return self._enter("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetTemperature(self, handle, sensor):
        gpu = self._enter("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._enter("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for v, fid in zip(values, fieldIds):
            v.fieldId = fid
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and gpu.memory_temperature is not None:
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = gpu.memory_temperature
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._enter("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._enter("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._enter("nvmlDeviceGetClockInfo", handle)
        if type != pynvml.NVML_CLOCK_SM:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization, memory=gpu.utilization // 2)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle).reasons

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", handle)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected
        return gpu.ecc_uncorrected

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._enter("nvmlDeviceGetPcieReplayCounter", handle).pcie_replays

    def _set(self, eventSet):
        entry = self._sets.get(ctypes.addressof(eventSet.contents))
        if entry is None:  # freed, or never created
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return entry

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        struct = pynvml.struct_c_nvmlEventSet_t()
        with self._lock:
            self._sets[ctypes.addressof(struct)] = (struct, set(), [])
        return pynvml.c_nvmlEventSet_t(struct)

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        self._enter("nvmlDeviceRegisterEvents", handle)  # GPU_IS_LOST for a lost GPU, as documented
        with self._lock:
            self._set(eventSet)[1].add(self._index(handle))

    def nvmlEventSetWait_v2(self, eventSet, timeoutms):
        """Events of the GPUs registered in ``eventSet``. While one of them is lost, every wait
        answers GPU_IS_LOST (NVML documents that code for the wait, not which GPU it is about),
        before any pending event: nothing more comes out of that set."""
        self._enter("nvmlEventSetWait_v2")
        with self._lock:
            _, registered, pending = self._set(eventSet)
            if any(self.gpus[i].error == pynvml.NVML_ERROR_GPU_IS_LOST for i in registered):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
            if not pending:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = pending.pop(0)
        data = pynvml.c_nvmlEventData_t()
        data.device = pynvml.c_nvmlDevice_t(self._structs[index])
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data

    def nvmlEventSetFree(self, eventSet):
        self._enter("nvmlEventSetFree")
        with self._lock:
            self._set(eventSet)
            del self._sets[ctypes.addressof(eventSet.contents)]
