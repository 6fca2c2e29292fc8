"""Hardware coupling: is it the hardware?

GPU and fabric series come from the node daemons' NVML and sysfs collectors; they carry no train_job
label, so every query joins them to the daemons (``instance``) that run ranks of the selected job.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import statetimeline, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.models import common as cm

from syncwatch.rules.thresholds import THRESHOLDS

from .common import (JOB, ON_DAEMON, ON_NODE, RATE, dashboard, legend_table, node_variable,
                     panel, query, thresholds, train_job_variable)

UID = "syncwatch-hardware"


def _gpu(metric: str) -> str:
    return f'max by (node, gpu) ({metric} {ON_DAEMON})'


def _rate(metric: str, by: str = "node, device") -> str:
    return f'sum by ({by}) (rate({metric}[{RATE}]) {ON_DAEMON})'


def build() -> db.Dashboard:
    # Skew and slack reach the daemons together, K steps' worth at a time, when the ranks' skew
    # exchange completes: both are divided by the steps that exchange covered (the skew
    # histogram's count). Divided by the steps of the interval instead, a waiting rank with 3 s
    # steps read 2.5 times its slack (50 steps of it over 20) and its node went below zero; an
    # interval without an exchange has no value rather than 0/0.
    def skew_rate(part: str) -> str:
        return f'sum by (train_job) (rate(syncwatch_barrier_skew_seconds_{part}{{{JOB}}}[{RATE}]))'

    late = (f'({skew_rate("sum")} - on (train_job) group_right () '
            f'rate(syncwatch_slack_seconds_total{{{JOB}}}[{RATE}]))'
            f' / on (train_job) group_left () ({skew_rate("count")} > 0)')
    # Without the exchange (K = 0), per job: the largest mean wait less the rank's own (the
    # estimated skew less the rank's estimated slack), from the rules' 5 m mean waits, which
    # they record for such jobs only.
    wait = f'train_job_rank:syncwatch_sync_wait:mean5m{{{JOB}}}'
    late_estimate = f'max by (train_job) ({wait}) - on (train_job) group_right () {wait}'
    # the node's latest rank, not the mean of its ranks: one hot GPU of 8 read an eighth of its
    # lateness, level with the jitter of healthy nodes
    lateness = f'max by (node) (({late} or on (train_job) ({late_estimate})) {ON_NODE})'
    lateness_panel = (
        panel(timeseries.Panel(), "Lateness of the ranks per node",
              "Mean time per step the barrier waited for the latest rank of each node (barrier "
              "skew minus the rank's own slack over the steps of the skew exchange; the node's "
              "largest, so one hot GPU shows whole). A node whose lateness rises with its temperature, falling clocks or a "
              "throttle reason is the hardware straggler. With the skew exchange, an interval "
              "without one (every K = 50 steps) has no point. Without it (K = 0) the lateness is "
              "an estimate from the ranks' mean waits over 5 m (the largest mean wait less the "
              "rank's own): it shows a persistently late node, but jitter averages out of it.",
              query(lateness, "{{node}}"), unit="s", w=8)
        .min(0).legend(legend_table("mean", "max").sort_by("Mean").sort_desc(True)))
    sync_tax = (
        panel(timeseries.Panel(), "Job sync tax",
              "Share of step time inside synchronization, and the coupling score (the share of "
              "it spent waiting for late ranks). Fabric trouble (xmit wait, CNPs, errors, flaps) "
              "that matters for this job shows up here at the same time. Without the skew "
              "exchange (K = 0) the coupling is an estimate from the ranks' mean waits.",
              query(f'train_job:syncwatch_sync_tax:ratio5m{{{JOB}}}', "sync tax"),
              query(f'train_job:syncwatch_coupling:ratio5m{{{JOB}}}', "coupling"),
              unit="percentunit", w=8)
        .min(0))
    # RDMA (NCCL over InfiniBand or RoCE) bypasses the network device: only the port counts it.
    rdma_rx = 'syncwatch_ib_port_data_bytes_total{direction="receive"}'
    rdma_tx = 'syncwatch_ib_port_data_bytes_total{direction="transmit"}'
    # The port errors SyncwatchIbLinkErrors reads besides link-downed, one series per counter
    # (label_replace: their increases share a label set, and `or` kept the first only).
    ib_errors = " or ".join(
        f'label_replace(increase(syncwatch_ib_{counter}_total[{RATE}]), "counter", "{name}", "", "")'
        for counter, name in (("symbol_errors", "symbol errors"), ("port_rcv_errors", "receive errors"),
                              ("link_integrity_errors", "link integrity errors"),
                              ("buffer_overrun_errors", "buffer overruns")))
    return (
        dashboard(UID, "syncwatch / Hardware coupling",
                  "Is it the hardware? GPU state per node beside the lateness of its ranks; fabric "
                  "counters beside the job's sync tax; GPU error events.",
                  train_job_variable(), node_variable())
        .with_row(db.Row("GPUs beside rank lateness"))
        .with_panel(lateness_panel)
        .with_panel(
            panel(timeseries.Panel(), "GPU temperature",
                  "Core temperature of each GPU of the job's nodes. One node hotter than the rest, "
                  "with clocks falling, usually explains its lateness (cooling, fan, airflow).",
                  query(_gpu("syncwatch_gpu_temperature_celsius"), "{{node}} gpu {{gpu}}"),
                  unit="celsius", w=8)
            .legend(legend_table("mean", "max").sort_by("Max").sort_desc(True)))
        .with_panel(
            panel(timeseries.Panel(), "GPU SM clock",
                  "Streaming-multiprocessor clock per GPU. Synchronous ranks all run at the pace "
                  "of the slowest GPU: one GPU with a lower clock slows the whole job.",
                  query(_gpu("syncwatch_gpu_sm_clock_hertz"), "{{node}} gpu {{gpu}}"),
                  unit="hertz", w=8)
            .legend(legend_table("mean", "min").sort_by("Min")))
        .with_panel(
            panel(timeseries.Panel(), "GPU power",
                  "Power draw per GPU. A GPU at its power cap (see throttle reasons) or drawing "
                  "much less than its peers while they wait is the one holding them back.",
                  query(_gpu("syncwatch_gpu_power_watts"), "{{node}} gpu {{gpu}}"),
                  unit="watt")
            .legend(legend_table("mean", "max")))
        .with_panel(
            panel(timeseries.Panel(), "GPU utilization",
                  "Share of time each GPU ran a kernel (NVML, over its last sample period). A "
                  "GPU much less busy than its peers is fed too slowly (data loading, CPU "
                  "contention on its node); all near 0 while the ranks still report: no kernels "
                  "run (a stall, or a pause on the host). NCCL's kernels count as busy while they "
                  "wait at the barrier, so a waiting GPU does not read idle.",
                  query(_gpu("syncwatch_gpu_utilization_ratio"), "{{node}} gpu {{gpu}}"),
                  unit="percentunit")
            .min(0).max(1).legend(legend_table("mean", "min")))
        .with_panel(
            panel(statetimeline.Panel(), "GPU throttle reasons",
                  "Clock event reasons that slow a GPU down, per node: 1 (red) while any GPU of "
                  "the node is throttled for that reason: thermal (sw_thermal, hw_thermal), "
                  "hardware (hw_slowdown, power_brake) or its power limit (power_cap), the "
                  "reasons the throttling alerts read. sw_thermal / hw_thermal / hw_slowdown on "
                  "the node with the late ranks is the hardware cause; power_cap on all nodes is "
                  "a site setting, not a straggler. Benign clock events (gpu_idle, "
                  "applications_clocks, sync_boost, display_clock) and the aggregate thermal (either "
                  "thermal reason) are left out.",
                  query(f'max by (node, reason) (syncwatch_gpu_throttle_active'
                        f'{{reason=~"{THRESHOLDS.throttle_reasons}"}} {ON_DAEMON})',
                        "{{node}} {{reason}}"),
                  w=24)
            .merge_values(True).show_value(cm.VisibilityMode.NEVER)
            .thresholds(thresholds((None, "green"), (1, "red"))))
        .with_row(db.Row("Fabric beside sync tax"))
        .with_panel(sync_tax)
        .with_panel(
            panel(timeseries.Panel(), "NIC throughput",
                  "Bytes per second received (positive) and transmitted (negative) per node: by "
                  "each network device (the host's IP traffic: data loading, checkpoints, "
                  "collectives over TCP sockets) and by each InfiniBand / RoCE port (device/port: "
                  "RDMA, the gradient collectives of NCCL over InfiniBand or RoCE, which the "
                  "network device's counters never see). Gradient traffic is bursty and equal "
                  "across nodes; one node lower than the rest in every burst is late or has a "
                  "degraded link.",
                  query(_rate("syncwatch_nic_receive_bytes_total"), "{{node}} {{device}} rx"),
                  query(f'-{_rate("syncwatch_nic_transmit_bytes_total")}', "{{node}} {{device}} tx"),
                  query(_rate(rdma_rx, "node, device, port"), "{{node}} {{device}}/{{port}} rx"),
                  query(f'-{_rate(rdma_tx, "node, device, port")}', "{{node}} {{device}}/{{port}} tx"),
                  unit="Bps", w=8))
        .with_panel(
            panel(timeseries.Panel(), "NIC errors, drops and link flaps",
                  "Errors and drops per second per node and device, and carrier changes (link flaps), "
                  "InfiniBand link-downed events and InfiniBand port errors (symbol, receive, link "
                  "integrity, buffer overrun: with link-downed, what SyncwatchIbLinkErrors reads) "
                  "per interval. Anything above zero during a sync tax rise is a fabric suspect.",
                  query(_rate("syncwatch_nic_errors_total"), "{{node}} {{device}} errors"),
                  query(_rate("syncwatch_nic_drops_total"), "{{node}} {{device}} drops"),
                  query(f'sum by (node, device) (increase(syncwatch_nic_carrier_changes_total[{RATE}]) {ON_DAEMON})',
                        "{{node}} {{device}} flaps"),
                  query(f'sum by (node, device) (increase(syncwatch_ib_link_downed_total[{RATE}]) {ON_DAEMON})',
                        "{{node}} {{device}} IB link down"),
                  query(f'sum by (node, device, port, counter) (({ib_errors}) {ON_DAEMON})',
                        "{{node}} {{device}}/{{port}} {{counter}}"),
                  unit="short", w=8)
            .min(0))
        .with_panel(
            panel(timeseries.Panel(), "InfiniBand port_xmit_wait",
                  "Rate of port_xmit_wait ticks per InfiniBand port: time the port had data to send "
                  "but no credits (the next hop was congested). Rising on all nodes with the sync "
                  "tax means fabric congestion, not a straggler.",
                  query(_rate("syncwatch_ib_port_xmit_wait_total", "node, device, port"),
                        "{{node}} {{device}}/{{port}}"),
                  unit="short", w=12)
            .min(0).axis_label("ticks/s"))
        .with_panel(
            panel(timeseries.Panel(), "RoCE congestion: CNP and ECN rates",
                  "Congestion notification packets sent and handled, and ECN-marked packets per "
                  "second, per RoCE port. A burst of CNPs with the sync tax is congestion control "
                  "slowing the collective; steady zero with a high sync tax points elsewhere.",
                  query(_rate("syncwatch_roce_cnp_sent_total", "node, device, port"),
                        "{{node}} {{device}}/{{port}} CNP sent"),
                  query(_rate("syncwatch_roce_cnp_handled_total", "node, device, port"),
                        "{{node}} {{device}}/{{port}} CNP handled"),
                  query(_rate("syncwatch_roce_ecn_marked_total", "node, device, port"),
                        "{{node}} {{device}}/{{port}} ECN marked"),
                  unit="pps", w=12)
            .min(0))
        .with_row(db.Row("GPU error events"))
        .with_panel(
            panel(table.Panel(), "XID errors",
                  "XID error events per GPU and XID code since the node daemon started (driver-"
                  "reported faults: 79 = GPU fell off the bus, 48/63/64 = ECC, 13/31/43 = "
                  "application faults). A count on a node with late ranks or before a restart is "
                  "the likely cause. Only GPUs that had an event are listed. Go by uuid: a GPU gone "
                  "from NVML's list keeps its XIDs under its last gpu index, which after the "
                  "renumbering may be another GPU's (a row each).",
                  query(f'sum by (node, gpu, uuid, xid) (syncwatch_gpu_xid_errors_total {ON_DAEMON})',
                        instant=True, table=True),
                  w=8)
            .sort_by([cb.TableSortByFieldState().display_name("Value").desc(True)]))
        .with_panel(
            panel(table.Panel(), "ECC errors",
                  "ECC error counts per GPU and type as NVML reports them. Uncorrected errors end "
                  "jobs; a climbing corrected count predicts them.",
                  query(f'sum by (node, gpu, type) (syncwatch_gpu_ecc_errors_total {ON_DAEMON})',
                        instant=True, table=True),
                  w=8)
            .sort_by([cb.TableSortByFieldState().display_name("Value").desc(True)]))
        .with_panel(
            panel(timeseries.Panel(), "GPUs answering",
                  "1 while NVML answers for the GPU; 0 when it is lost, timed out or needs a reset "
                  "(the ranks on it will hang or die), or gone from NVML's list since the "
                  "daemon started: 0 at its last index, even where another GPU now has it.",
                  query(f'min by (node, gpu) (syncwatch_gpu_up {ON_DAEMON})', "{{node}} gpu {{gpu}}"),
                  w=8)
            .min(0).max(1))
    )
