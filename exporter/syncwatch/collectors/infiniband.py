"""InfiniBand and RoCE ports from ``<sysfs>/class/infiniband/*/ports/*``.

``counters/`` holds the IB port counters (both link layers; ``port_xmit_data``/``port_rcv_data``
count 4-byte words, hence ×4). ``hw_counters/`` holds the mlx5 queue counters (out of sequence,
retransmits) on InfiniBand and RoCE ports alike, and the RoCE congestion-control counters.
A port without a performance-management agent reads ``N/A (no PMA)``: quietly absent. A port
whose state is DOWN has no rate series: its link trained no speed, and the kernel's ``rate`` then
shows SDR, the default it prints for an invalid speed (e.g. ``10 Gb/sec (4X SDR)``), as the net
collector drops the speed of a down link.
"""

from __future__ import annotations

import os
import re

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .base import CollectorOptions, NoData, register
from .sysfs import Absent, Unreadable, label_value, list_dir, read_int, read_or_none, read_text

# The IBTA port states a link carries traffic in: the kernel prints "4: ACTIVE", "5: ACTIVE_DEFER"
_ACTIVE = ("ACTIVE", "ACTIVE_DEFER")

# counters/<file> -> metric name (without _total) and help
_PORT_COUNTERS = {
    "port_xmit_wait": ("syncwatch_ib_port_xmit_wait",
                       "Ticks during which the port had data to send but no flow-control credits."),
    "link_downed": ("syncwatch_ib_link_downed", "Times the link went down after failing error recovery."),
    "symbol_error": ("syncwatch_ib_symbol_errors", "Minor link errors detected on a physical lane."),
    "port_rcv_errors": ("syncwatch_ib_port_rcv_errors", "Received packets containing an error."),
    "local_link_integrity_errors": ("syncwatch_ib_link_integrity_errors",
                                    "Times the local physical errors exceeded their threshold."),
    "excessive_buffer_overrun_errors": ("syncwatch_ib_buffer_overrun_errors",
                                        "Consecutive flow-control update periods with a buffer overrun."),
}
# hw_counters/<file> -> metric name, help
_ROCE_COUNTERS = {
    "np_cnp_sent": ("syncwatch_roce_cnp_sent", "Congestion notification packets sent (notification point)."),
    "rp_cnp_handled": ("syncwatch_roce_cnp_handled",
                       "Congestion notification packets handled by the reaction point (rate reductions)."),
    "np_ecn_marked_roce_packets": ("syncwatch_roce_ecn_marked", "RoCE packets received with an ECN mark."),
    "out_of_sequence": ("syncwatch_roce_out_of_sequence", "Out-of-sequence packets received."),
}
# hw_counters/<file> -> reason label of syncwatch_roce_retransmits_total
_RETRANSMITS = {"local_ack_timeout_err": "ack_timeout", "packet_seq_err": "nak_sequence"}

_RATE = re.compile(r"^\s*([0-9.]+)\s*([GM])b/sec")


def parse_rate(text: str) -> float:
    """``'200 Gb/sec (4X HDR)'`` -> bytes per second."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * (1e9 if m.group(2) == "G" else 1e6) / 8


class InfinibandCollector:
    def __init__(self, sysfs: str = "/sys"):
        self.root = os.path.join(sysfs, "class", "infiniband")

    def update(self, errors: list[str]):
        if not os.path.isdir(self.root):
            raise NoData(f"{self.root} does not exist")
        dp = ["device", "port"]
        data = CounterMetricFamily("syncwatch_ib_port_data_bytes",
                                   "Port data in bytes (sysfs counts 4-byte words).",
                                   labels=["device", "port", "direction"])
        counters = {f: CounterMetricFamily(n, h, labels=dp) for f, (n, h) in _PORT_COUNTERS.items()}
        roce = {f: CounterMetricFamily(n, h, labels=dp) for f, (n, h) in _ROCE_COUNTERS.items()}
        retrans = CounterMetricFamily("syncwatch_roce_retransmits",
                                      "Events that made the sender retransmit, by reason.",
                                      labels=["device", "port", "reason"])
        up = GaugeMetricFamily("syncwatch_ib_port_up", "1 if the port state is ACTIVE or ACTIVE_DEFER.",
                               labels=dp)
        rate = GaugeMetricFamily("syncwatch_ib_port_rate_bytes",
                                 "Port rate in bytes per second (none for a port in state DOWN).",
                                 labels=dp)

        def value(path: str, read=read_int):
            return read_or_none(path, errors, read)

        for dev in list_dir(self.root):
            ports_dir = os.path.join(self.root, dev, "ports")
            try:
                ports = list_dir(ports_dir)
            except (Absent, Unreadable) as e:  # vanished or unreadable device
                if isinstance(e, Unreadable):
                    errors.append(str(e))
                continue
            for port in ports:
                base = os.path.join(ports_dir, port)
                labels = [label_value(dev), label_value(port)]
                cdir = os.path.join(base, "counters")
                for direction, name in (("transmit", "port_xmit_data"), ("receive", "port_rcv_data")):
                    words = value(os.path.join(cdir, name))
                    if words is not None:
                        data.add_metric([*labels, direction], words * 4)
                for name, fam in counters.items():
                    v = value(os.path.join(cdir, name))
                    if v is not None:
                        fam.add_metric(labels, v)
                hdir = os.path.join(base, "hw_counters")
                for name, fam in roce.items():
                    v = value(os.path.join(hdir, name))
                    if v is not None:
                        fam.add_metric(labels, v)
                for name, reason in _RETRANSMITS.items():
                    v = value(os.path.join(hdir, name))
                    if v is not None:
                        retrans.add_metric([*labels, reason], v)
                state = value(os.path.join(base, "state"), read_text)  # "4: ACTIVE"
                if state is not None:
                    up.add_metric(labels, 1 if state.partition(":")[2].strip() in _ACTIVE else 0)
                if state is not None and state.endswith("DOWN"):
                    continue  # no link, no rate: the kernel's rate reads SDR, its default
                text = value(os.path.join(base, "rate"), read_text)
                if text is not None:
                    try:
                        rate.add_metric(labels, parse_rate(text))
                    except ValueError:
                        errors.append(f"{os.path.join(base, 'rate')}: unparsable rate {text[:40]!r}")
        return [data, *counters.values(), *roce.values(), retrans, up, rate]


@register("infiniband", default=True,
          help="InfiniBand port counters and RoCE congestion counters from /sys/class/infiniband")
def _make(options: CollectorOptions) -> InfinibandCollector:
    return InfinibandCollector(options.sysfs)
