"""Writes sysfs trees shaped like a real host's: ``class/net/<dev>/...`` and
``class/infiniband/<dev>/ports/<n>/{counters,hw_counters}/...``.

The one writer of fake sysfs in the project: the simulator's hardware (``sim.hardware``) and the
collectors' fixture trees (``tests/fixtures/make_sysfs.py``) both build on it. File names and the
formats of ``state``/``rate``/``phys_state`` are the kernel's (mlx5 driver for ``hw_counters``).
"""

from __future__ import annotations

import os
from pathlib import Path

NET_STATS = ["collisions", "multicast", "rx_bytes", "rx_compressed", "rx_crc_errors", "rx_dropped",
             "rx_errors", "rx_fifo_errors", "rx_frame_errors", "rx_length_errors", "rx_missed_errors",
             "rx_nohandler", "rx_over_errors", "rx_packets", "tx_aborted_errors", "tx_bytes",
             "tx_carrier_errors", "tx_compressed", "tx_dropped", "tx_errors", "tx_fifo_errors",
             "tx_heartbeat_errors", "tx_packets", "tx_window_errors"]
IB_COUNTERS = ["VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
               "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets",
               "port_rcv_constraint_errors", "port_rcv_data", "port_rcv_errors", "port_rcv_packets",
               "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors",
               "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards", "port_xmit_packets",
               "port_xmit_wait", "symbol_error", "unicast_rcv_packets", "unicast_xmit_packets"]
# bits of each counters/ file: the field of PortCounters, or of PortCountersExtended for the data
# and packet counters where the port has it (mlx5 has), that drivers/infiniband/core/sysfs.c
# prints. A field stops at its maximum: a wider value is one no port shows.
PMA_WIDTHS = {"symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
              "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16,
              "port_xmit_discards": 16, "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8,
              "local_link_integrity_errors": 4, "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16,
              "port_xmit_wait": 32, "port_xmit_data": 64, "port_rcv_data": 64, "port_xmit_packets": 64,
              "port_rcv_packets": 64, "unicast_xmit_packets": 64, "unicast_rcv_packets": 64,
              "multicast_xmit_packets": 64, "multicast_rcv_packets": 64}
# hw_counters/ (drivers/infiniband/hw/mlx5/counters.c): the mlx5 queue counters (and the core's
# lifespan), on every port whatever its link layer; then those that come with firmware
# capabilities (congestion: cc_query_allowed, RoCE acceleration: roce_accl, rx_icrc_encapsulated),
# written for a RoCE port only: the InfiniBand HCA written here is one without them.
QUEUE_COUNTERS = ["duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err",
                  "out_of_buffer", "out_of_sequence", "packet_seq_err", "req_cqe_error",
                  "req_cqe_flush_error", "req_remote_access_errors", "req_remote_invalid_request",
                  "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error",
                  "resp_remote_access_errors", "rnr_nak_retry_err", "rx_atomic_requests",
                  "rx_read_requests", "rx_write_requests"]
ROCE_COUNTERS = ["np_cnp_sent", "np_ecn_marked_roce_packets", "roce_adp_retrans", "roce_adp_retrans_to",
                 "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans",
                 "rp_cnp_handled", "rp_cnp_ignored", "rx_icrc_encapsulated"]
HW_COUNTERS = sorted(QUEUE_COUNTERS + ROCE_COUNTERS)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class Counters:
    """Counter attributes advanced by one writer, their values kept in memory.

    ``bump(path, by)`` adds ``by`` to the counter file ``path`` (read once, on its first bump),
    replacing the file whole: a reader never sees it half written (a sysfs attribute reads
    atomically). A port counter (``counters/<name>``) stops at its field's maximum
    (``PMA_WIDTHS``), as the port's counters saturate; netdev statistics and the
    ``hw_counters`` advanced here (the 64-bit congestion counters) go on. Four system calls a
    bump, since each one lets other threads take the interpreter lock: the simulator's hardware
    bumps dozens of files per tick."""

    def __init__(self):
        self._values: dict[Path, int] = {}
        self._limits: dict[Path, int | None] = {}

    def bump(self, path: Path, by: int) -> None:
        value = self._values.get(path)
        if value is None:
            value = int(path.read_text())
            width = PMA_WIDTHS.get(path.name) if path.parent.name == "counters" else None
            self._limits[path] = None if width is None else 2 ** width - 1
        value += by
        limit = self._limits[path]
        if limit is not None and value > limit:
            value = limit  # saturated: the congestion scenario passed port_xmit_wait's in ~52.6k steps
        self._values[path] = value
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, b"%d\n" % value)
        finally:
            os.close(fd)
        os.replace(tmp, path)


def nic(root: Path, dev: str, *, speed: str, operstate: str = "up", carrier_changes: int = 2,
        mtu: int = 9000, stats: dict[str, int] | None = None, skip: tuple[str, ...] = (),
        pci: str | None = "0000:17:00.0") -> Path:
    """A network interface; returns its directory. ``skip`` leaves attributes out. As in real
    sysfs, the directory is the device's, under its PCI function ``pci`` (a physical NIC) or,
    with ``pci=None``, under ``devices/virtual/net`` (loopback, bridges, veths), and
    ``class/net/<dev>`` is a symlink to it."""
    home = Path("devices", "virtual") if pci is None else Path("devices", "pci0000:00", pci)
    base = root / home / "net" / dev
    link = root / "class" / "net" / dev
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(Path("..", "..", home, "net", dev))
    values = {"rx_bytes": 918_273_645_120, "tx_bytes": 905_112_334_080, "rx_packets": 231_004_512,
              "tx_packets": 228_771_903, **(stats or {})}
    for name in NET_STATS:
        if name not in skip:
            write(base / "statistics" / name, str(values.get(name, 0)))
    for name, text in (("operstate", operstate), ("speed", speed), ("carrier_changes", str(carrier_changes)),
                       ("carrier", "1" if operstate == "up" else "0"), ("mtu", str(mtu)), ("type", "1")):
        if name not in skip:
            write(base / name, text)
    return base


def ib_port(root: Path, dev: str, port: int, *, link_layer: str, state: str = "4: ACTIVE",
            phys_state: str = "5: LinkUp", rate: str = "200 Gb/sec (4X HDR)",
            counters: dict[str, int | str] | None = None, hw: dict[str, int] | None = None,
            no_pma: bool = False, hw_counters: bool = True) -> Path:
    """A port of HCA ``dev`` (``link_layer`` "InfiniBand" or "Ethernet" for RoCE); returns its
    directory. ``hw_counters`` adds the mlx5 ``hw_counters/``: the queue counters, and on a RoCE
    port the congestion-control and RoCE counters too; ``no_pma`` makes every port counter read
    ``N/A (no PMA)``. A counter value wider than its field (``PMA_WIDTHS``; 32 bits for a queue
    counter) is a ValueError."""
    base = root / "class" / "infiniband" / dev / "ports" / str(port)
    write(base / "state", state)
    write(base / "phys_state", phys_state)
    write(base / "rate", rate)
    write(base / "link_layer", link_layer)
    values = {"port_xmit_data": 2_503_104_811_520, "port_rcv_data": 2_498_775_012_864,
              "port_xmit_packets": 4_880_112_300, "port_rcv_packets": 4_871_455_128, **(counters or {})}
    for name, value in values.items():
        if isinstance(value, int) and not 0 <= value < 2 ** PMA_WIDTHS[name]:
            raise ValueError(f"{name} {value}: the kernel's field is {PMA_WIDTHS[name]} bits")
    for name in IB_COUNTERS:
        write(base / "counters" / name, "N/A (no PMA)" if no_pma else str(values.get(name, 0)))
    if hw_counters:
        hv = {"rx_write_requests": 91_234_003, "rx_read_requests": 1_200, **(hw or {})}
        for name, value in hv.items():
            if name in QUEUE_COUNTERS and not 0 <= value < 2 ** 32:
                raise ValueError(f"{name} {value}: mlx5 reads its queue counters as 32 bits")
        for name in HW_COUNTERS if link_layer == "Ethernet" else QUEUE_COUNTERS:
            write(base / "hw_counters" / name, str(hv.get(name, 0)))
    write(root / "class" / "infiniband" / dev / "node_type", "1: CA")
    write(root / "class" / "infiniband" / dev / "fw_ver", "20.39.1002")
    return base
