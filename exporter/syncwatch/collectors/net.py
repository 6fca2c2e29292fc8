"""Network interfaces from ``<sysfs>/class/net/*``: traffic, errors, drops, link state and flaps."""

from __future__ import annotations

import os
import re

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .base import CollectorOptions, NoData, register
from .sysfs import label_value, list_dir, read_int, read_or_none, read_text

_DIRECTIONS = (("receive", "rx"), ("transmit", "tx"))
_VIRTUAL = os.path.join(os.sep, "devices", "virtual", "")  # where sysfs keeps virtual netdevs


class NetCollector:
    """One series set per interface; every file is read under its own guard, so a missing or bad
    file drops only its own series.

    Virtual interfaces are skipped unless ``virtual``: those whose ``class/net`` entry links
    under ``devices/virtual`` (loopback, bridges such as docker0 and cni0, veth pairs and
    Calico's cali*, VXLAN and other tunnels, bonds, VLANs), where a physical NIC's links under its
    bus device. Their traffic is that of the physical NICs below them, and their carrier changes
    follow containers coming and going: a bridge's flips when its first or last port comes or
    goes, which would keep SyncwatchNicLinkErrors firing on nodes where pods start and stop."""

    def __init__(self, sysfs: str = "/sys", exclude: str = CollectorOptions.net_exclude,
                 virtual: bool = CollectorOptions.net_virtual):
        self.root = os.path.join(sysfs, "class", "net")
        self.exclude = re.compile(exclude) if exclude else None
        self.virtual = virtual

    def update(self, errors: list[str]):
        if not os.path.isdir(self.root):
            raise NoData(f"{self.root} does not exist")
        d = ["device"]
        dd = ["device", "direction"]
        fams = {
            "rx_bytes": CounterMetricFamily("syncwatch_nic_receive_bytes", "Bytes received.", labels=d),
            "tx_bytes": CounterMetricFamily("syncwatch_nic_transmit_bytes", "Bytes transmitted.", labels=d),
            "rx_packets": CounterMetricFamily("syncwatch_nic_receive_packets", "Packets received.", labels=d),
            "tx_packets": CounterMetricFamily("syncwatch_nic_transmit_packets", "Packets transmitted.", labels=d),
            "errors": CounterMetricFamily("syncwatch_nic_errors", "Interface errors by direction.", labels=dd),
            "drops": CounterMetricFamily("syncwatch_nic_drops", "Packets dropped by direction.", labels=dd),
            "up": GaugeMetricFamily("syncwatch_nic_up", "1 if the interface operstate is up.", labels=d),
            "speed": GaugeMetricFamily("syncwatch_nic_speed_bytes",
                                       "Negotiated link speed in bytes per second.", labels=d),
            "flaps": CounterMetricFamily("syncwatch_nic_carrier_changes",
                                         "Carrier changes (link flaps) since the driver loaded.", labels=d),
        }

        def value(path: str, read=read_int):
            return read_or_none(path, errors, read)

        for dev in list_dir(self.root):
            if self.exclude is not None and self.exclude.match(dev):
                continue
            base = os.path.join(self.root, dev)
            if not self.virtual and _VIRTUAL in os.path.realpath(base):
                continue
            dev = label_value(dev)
            stats = os.path.join(base, "statistics")
            for key in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets"):
                v = value(os.path.join(stats, key))
                if v is not None:
                    fams[key].add_metric([dev], v)
            for direction, prefix in _DIRECTIONS:
                for key, suffix in (("errors", "errors"), ("drops", "dropped")):
                    v = value(os.path.join(stats, f"{prefix}_{suffix}"))
                    if v is not None:
                        fams[key].add_metric([dev, direction], v)
            state = value(os.path.join(base, "operstate"), read_text)
            if state is not None:
                fams["up"].add_metric([dev], 1 if state == "up" else 0)
            speed = value(os.path.join(base, "speed"))
            if speed is not None and speed >= 0:  # -1: unknown (virtio, down links)
                fams["speed"].add_metric([dev], speed * 1_000_000 / 8)
            flaps = value(os.path.join(base, "carrier_changes"))
            if flaps is not None:
                fams["flaps"].add_metric([dev], flaps)
        return list(fams.values())


@register("net", default=True, help="network interface counters and link state from /sys/class/net")
def _make(options: CollectorOptions) -> NetCollector:
    return NetCollector(options.sysfs, options.net_exclude, options.net_virtual)
