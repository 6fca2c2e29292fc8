"""Alerting rules, one builder per concern (one rendered file each).

Every alert: ``Syncwatch<UpperCamel>`` name, ``severity`` (critical pages a person, warning goes to
a work queue, info is context), a fixed ``summary``, a templated ``description`` naming the train
job, rank and node where the series carries them, and a ``runbook_url`` to the alert's section of
docs/runbook.md (anchor = the lower-cased alert name).
"""

from __future__ import annotations

from ..protocol import PAUSES
from .recording import RANK_NODE
from .render import Ctx

JOB = "{{ $labels.train_job }}"
RANK = "{{ $labels.rank }}"
NODE = "{{ $labels.node }}"
INSTANCE = "{{ $labels.instance }}"
PCT = "{{ $value | humanizePercentage }}"


def _num(fmt: str = "%.2f") -> str:
    return '{{ $value | printf "' + fmt + '" }}'


def alert(c: Ctx, name: str, expr: str, for_: float | None, severity: str, summary: str,
          description: str) -> dict:
    assert name.startswith("Syncwatch") and severity in ("critical", "warning", "info"), name
    rule = {"alert": name, "expr": expr}
    if for_ is not None:
        rule["for"] = c.d(for_)
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description,
                           "runbook_url": f"{c.runbook_base}#{name.lower()}"}
    return rule


def with_node(expr: str) -> str:
    """Give a per-(train_job, rank) expression the rank's ``node`` label (value unchanged)."""
    return f"(\n{expr}\n)\n* on (train_job, rank) group_left (node)\n{RANK_NODE}"


def running(c: Ctx, expr: str) -> str:
    """``expr`` less the jobs that completed: a rank of theirs ended ``completed`` in the lost
    lookback, and none still runs. The 5- and 10-minute windows of their records outlive their
    series by minutes: a real straggler job that completed 3 minutes before BarrierSkewHigh's
    15m ``for:`` ran out fired it then, and JobUnstable, after its series had gone."""
    return (f"(\n{expr}\n)\nunless on (train_job)\n(\n"
            f"  group by (train_job) (\n    max_over_time(syncwatch_rank_end_timestamp_seconds"
            f"{{reason=\"completed\"}}[{c.d(c.windows.lost_lookback)}])\n  )\n"
            f"  unless on (train_job)\n  group by (train_job) (\n"
            f"    {LIVE_RANKS.replace(chr(10), chr(10) + '    ')}\n  )\n)")


def variance(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    return [
        alert(c, "SyncwatchStepTimeVarianceGrowing",
              running(c, f"train_job:syncwatch_step_cv:avg5m > {t.cv_page:g}\n"
                         f"or\n(\n  train_job:syncwatch_step_cv:avg5m > {t.cv_growth_min:g}\n"
                         f"  and\n  train_job:syncwatch_step_cv:growth >= {t.cv_growth_page:g}\n)"),
              w.for_variance, "critical",
              "Step-time variance of a train job is growing.",
              f"Step-time CV of train job {JOB} is {_num('%.3f')} over the last {c.d(w.rate)} "
              f"(pages above {t.cv_page:g}, or above {t.cv_growth_min:g} and at "
              f"{t.cv_growth_page:g}x its own CV of "
              f"{c.d(w.baseline_offset)}-{c.d(w.baseline_offset + w.baseline)} ago). "
              f"Every rank waits for the slowest at each collective: growing variance is lost "
              f"throughput and an early sign of a failing node or a congested fabric."),
        alert(c, "SyncwatchJobUnstable",
              running(c, f"train_job:syncwatch_instability:score > {t.instability_warn:g}"),
              w.for_instability, "warning",
              "Instability score of a train job is high.",
              f"Instability score of train job {JOB} is {_num()} (warns above {t.instability_warn:g}); "
              f"see train_job:syncwatch_instability:component for which of step CV, counter CV, "
              f"CV growth, barrier skew, skew growth, oscillation, re-runs and restarts drives it."),
        alert(c, "SyncwatchStepTimeOscillating",
              running(c, f"train_job:syncwatch_step_autocorrelation:avg < -{t.oscillation_warn:g}"),
              w.for_oscillation, "warning",
              "Step time of a train job oscillates between fast and slow steps.",
              f"Lag-1 autocorrelation of step time in train job {JOB} is {_num()} "
              f"(warns below -{t.oscillation_warn:g}): fast and slow steps alternate, typically "
              f"a pipeline or prefetch imbalance or two groups of ranks taking turns to wait."),
    ]


def stragglers(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    return [
        alert(c, "SyncwatchPersistentStraggler",
              running(c, f"train_job_rank:syncwatch_last_arrival:ratio10m >= {t.straggler_share:g}\n"
                         f"and on (train_job)\n"
                         f"train_job:syncwatch_coupling:ratio5m >= {t.straggler_min_coupling:g}"),
              w.for_straggler, "critical",
              "One rank persistently holds back its train job.",
              f"Rank {RANK} on node {NODE} arrived last at the barrier in {PCT} of the steps of "
              f"train job {JOB} over the last {c.d(w.concentration)} (with the skew exchange off: "
              f"of the minutes, estimated from mean waits), while its peers idle at least "
              f"{t.straggler_min_coupling:.0%} of their time waiting. Check that node's GPU "
              f"(throttling, clocks), its NIC and its data loader."),
        alert(c, "SyncwatchBarrierSkewHigh",
              running(c, f"train_job:syncwatch_skew_step:ratio5m > {t.skew_step_warn:g}"),
              w.for_skew, "warning",
              "Ranks of a train job arrive at the barrier far apart.",
              f"Mean barrier skew of train job {JOB} is {PCT} of its step time over the last "
              f"{c.d(w.rate)} (warns above {t.skew_step_warn:.0%})."),
        alert(c, "SyncwatchCouplingHigh",
              running(c, f"train_job:syncwatch_coupling:ratio5m > {t.coupling_warn:g}"),
              w.for_coupling, "warning",
              "Ranks of a train job spend much of their time waiting for each other.",
              f"Ranks of train job {JOB} idle {PCT} of their time waiting for slower peers "
              f"(warns above {t.coupling_warn:.0%})."),
    ]


def pausing(c: Ctx, by: str) -> str:
    """The (train_job[, rank]) with a rank in a planned pause, saving a checkpoint or evaluating
    (its heartbeats' phase), for less than the allowance: a long save or evaluation makes no
    step and may enter no collective, yet is no stall. Not a rank that ended: its phase is
    frozen, and one that failed during a save held JobStalled off for the ranks it left waiting
    until its series went."""
    return (f'max by ({by}) (\n  syncwatch_rank_phase_elapsed_seconds{{phase=~"{"|".join(PAUSES)}"}}\n'
            f"  unless on (train_job, rank) syncwatch_rank_end_timestamp_seconds\n)"
            f" < {c.seconds(c.windows.pause_allowance)}")


# The ranks that report and have not ended: after its end record (any reason) a rank's series stay
# for the daemon's --job-grace (120 s), its last step and phase frozen. A job whose last step came
# minutes before its end (a final save or evaluation, then its teardown) made "no step for 5m,
# ranks report" true there, and JobStalled paged for a job that had completed.
LIVE_RANKS = ("syncwatch_rank_info\n  unless on (train_job, rank)\n"
              "  syncwatch_rank_end_timestamp_seconds")


def progress(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    return [
        alert(c, "SyncwatchJobStalled",
              f"(\n  time() - max by (train_job) (syncwatch_last_step_timestamp_seconds)\n)\n"
              # the remembered step time has no value once the job made no step for the whole
              # memory (no window with a step to divide by): then the allowance is stall_min, and
              # the alert stays on
              f"> on (train_job)\n(\n  clamp_min(\n"
              f"    {t.stall_factor:g} * max_over_time(train_job:syncwatch_step_seconds:mean5m[{c.d(w.stall_memory)}]),\n"
              f"    {c.seconds(w.stall_min)}\n  )\n"
              f"  or on (train_job)\n"
              f"  0 * group by (train_job) (syncwatch_rank_info) + {c.seconds(w.stall_min)}\n)\n"
              f"and on (train_job)\ngroup by (train_job) (\n  {LIVE_RANKS}\n)\n"
              f"unless on (train_job)\n{pausing(c, 'train_job')}",
              w.for_stall, "critical",
              "A train job makes no progress although its ranks are alive.",
              f"No rank of train job {JOB} completed a step for {{{{ $value | humanizeDuration }}}} "
              f"(more than {t.stall_factor:g}x its recent step time, at least "
              f"{c.d(w.stall_min)}), yet its ranks still report. Look for a rank stuck in a "
              f"collective (SyncwatchRankDesynchronized), a hung data loader or storage."),
        # a rank's step timestamp exists from its process's first step on: before it (a job that
        # hangs in its start, or again after a restart) JobStalled has no time to measure from
        alert(c, "SyncwatchJobStuckAtStart",
              f"count by (train_job) (max by (train_job, rank) (\n  {LIVE_RANKS}\n))\n"
              "unless on (train_job)\n"
              "group by (train_job) (syncwatch_last_step_timestamp_seconds)\n"
              f"unless on (train_job)\n{pausing(c, 'train_job')}",
              w.for_first_step, "critical",
              "A train job's ranks are alive but none has completed a step since it started.",
              f"{_num('%.0f')} rank(s) of train job {JOB} report, yet none has completed a step "
              f"in its process for {c.d(w.for_first_step)}: the job (or its restart) hangs before "
              f"its first step. Look for a rendezvous or first collective that never completes "
              f"(SyncwatchRankDesynchronized), a data loader that never yields, a load or compile "
              f"that never ends."),
        alert(c, "SyncwatchRankDesynchronized",
              with_node(
                  "  (\n    max by (train_job) (syncwatch_collective_sequence)\n"
                  "    - on (train_job) group_right\n"
                  "    max by (train_job, rank) (syncwatch_collective_sequence)\n  ) > 0\n"
                  "  and on (train_job, rank)\n"
                  f"  max by (train_job, rank) (changes(syncwatch_collective_sequence[{c.d(w.desync)}])) == 0\n"
                  f"  unless on (train_job, rank)\n  {pausing(c, 'train_job, rank').replace(chr(10), chr(10) + '  ')}"),
              w.for_desync, "critical",
              "A rank is stuck behind the collectives of its train job.",
              f"Rank {RANK} on node {NODE} of train job {JOB} is {_num('%.0f')} collective(s) "
              f"behind the furthest rank and has entered none for {c.d(w.desync)}: it is stuck "
              f"(hung process, dead GPU, mismatched collective) and the whole job waits on it."),
        alert(c, "SyncwatchRankLost",
              # a rank last seen through a daemon that cannot be scraped is not known to be
              # lost: SyncwatchDaemonDown says so (a warning, at 5m: before it, every rank of a
              # restarting daemon's node paged critical at 2m)
              f"(\n  max by (train_job, rank, node) (\n"
              f"    max_over_time(syncwatch_rank_info[{c.d(w.lost_lookback)}])\n"
              f"    unless on (instance)\n    (up{{job=\"{c.thresholds.scrape_job}\"}} == 0)\n  )\n"
              f"  unless on (train_job, rank)\n  syncwatch_rank_info\n"
              # a rank that said it completed ended, it was not lost: one that exits while
              # rank 0 still saves or evaluates for minutes paged once its series went
              f"  unless on (train_job, rank)\n"
              f"  max_over_time(syncwatch_rank_end_timestamp_seconds{{reason=\"completed\"}}"
              f"[{c.d(w.lost_lookback)}])\n)\n"
              f"and on (train_job)\ngroup by (train_job) (syncwatch_rank_info)\n"
              # a job whose every rank of its current world reports lost none: the ranks gone
              # are an earlier, larger world's (an elastic job that shrank), which had paged
              # for the whole lookback
              f"unless on (train_job)\n"
              f"(\n  count by (train_job) (max by (train_job, rank) (syncwatch_rank_info))\n"
              f"  >= on (train_job)\n  max by (train_job) (syncwatch_job_world_size)\n)",
              w.for_lost, "critical",
              "A rank of a running train job stopped reporting.",
              f"Rank {RANK} of train job {JOB}, last seen on node {NODE}, stopped reporting "
              f"while other ranks of the job still run: the process died or its node daemon "
              f"cannot hear it."),
    ]


def restarts(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    return [
        alert(c, "SyncwatchJobRestarting",
              f"train_job:syncwatch_restarts:increase1h >= {t.restarts_warn:g}",
              w.for_restarts, "warning",
              "A train job restarts repeatedly.",
              f"Train job {JOB} restarted {_num('%.0f')} times in the last {c.d(w.restarts)}."),
        alert(c, "SyncwatchJobCrashLooping",
              f"train_job:syncwatch_restarts:increase1h >= {t.restarts_crit:g}",
              w.for_restarts, "critical",
              "A train job is crash-looping.",
              f"Train job {JOB} restarted {_num('%.0f')} times in the last {c.d(w.restarts)}: "
              f"it burns its allocation re-running work."),
        alert(c, "SyncwatchRerunWorkHigh",
              f"train_job:syncwatch_rerun:ratio1h > {t.rerun_warn:g}",
              w.for_rerun, "warning",
              "A train job spends much of its time re-running lost work.",
              f"{PCT} of the steps train job {JOB} executed in the last {c.d(w.restarts)} "
              f"re-ran work lost to restarts (warns above {t.rerun_warn:.0%}): checkpoint more "
              f"often or fix what restarts it."),
    ]


def efficiency(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    return [
        alert(c, "SyncwatchEfficiencyDrift",
              running(c, f"train_job:syncwatch_efficiency:ratio_to_baseline < {t.efficiency_warn:g}"),
              w.for_efficiency, "warning",
              "Per-GPU throughput of a train job fell below its trailing baseline.",
              f"Per-GPU throughput of train job {JOB} is {PCT} of its own baseline, its mean "
              f"over the {c.d(w.trailing)} that ended {c.d(w.trailing_offset)} ago (warns below "
              f"{t.efficiency_warn:.0%})."),
        alert(c, "SyncwatchEnergyOutpacingOutput",
              running(c, "train_job:syncwatch_energy_per_sample:joules5m\n/\n"
                         f"train_job:syncwatch_energy_per_sample:baseline1h > {t.energy_warn:g}"),
              w.for_energy, "warning",
              "A train job spends more energy per sample than it used to.",
              f"Energy per sample of train job {JOB} is {_num()}x its baseline, its mean over the "
              f"{c.d(w.trailing)} that ended {c.d(w.trailing_offset)} ago (warns above "
              f"{t.energy_warn:g}x): GPUs burn power while waiting."),
    ]


def hardware(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    hw = c.d(w.hardware)
    throttled = f'syncwatch_gpu_throttle_active{{reason=~"{t.throttle_reasons}"}} == 1'
    # The straggler's own GPU, joined on its uuid: joined on the node alone, a node hosting the
    # stragglers of two jobs (a slow node slows every job on it) matched two series for one
    # daemon, the rule failed to evaluate ("many-to-many matching not allowed") and the alert
    # was gone cluster-wide; and a throttling GPU of another rank is not this rank's cause. The
    # topk keeps the join unique even for two ranks sharing a GPU. The straggler is the one
    # SyncwatchPersistentStraggler names, its peers' idling included: a rank last by a hair in
    # every step (one that logs; a single-rank job's, always) costs them nothing, and its GPU at
    # its power cap under full load is no straggler's cause.
    straggler_gpus = (
        "topk by (instance, uuid) (1,\n"
        "  group by (instance, uuid, train_job, rank, node) (\n"
        f"    {RANK_NODE}\n"
        "    and on (train_job, rank)\n"
        f"    train_job_rank:syncwatch_last_arrival:ratio10m >= {t.straggler_share:g}\n"
        "    and on (train_job)\n"
        f"    train_job:syncwatch_coupling:ratio5m >= {t.straggler_min_coupling:g}\n  )\n)")

    def xid_recent(selector: str) -> str:
        """An XID the daemon received in the hardware window. Read from its count (``increase``,
        or a series new in the window) it missed an XID whose series appeared within a window of
        Prometheus first scraping the daemon (new for one evaluation, shorter than ``for:``), and
        the same XID recurring after a daemon restart (1, gap, 1: no increase, and not new). An
        XID received before the window does not page, however late Prometheus first sees it."""
        return (f"time() - syncwatch_gpu_xid_last_event_timestamp_seconds{{{selector}}}\n"
                f"< {c.seconds(w.hardware)}")

    # Each counter apart, told apart by a label: one increase() of all five at once (a
    # ``__name__`` regex) drops their names and keeps the port's labels five times, so the rule
    # failed to evaluate ("vector cannot contain metrics with the same labelset") on every daemon
    # with an InfiniBand port, which exports all five.
    ib_errors = "\n  or\n  ".join(
        f'label_replace(increase(syncwatch_ib_{name}_total[{hw}]), "counter", "{name}", "", "")'
        for name in ("symbol_errors", "port_rcv_errors", "link_integrity_errors",
                     "buffer_overrun_errors", "link_downed"))
    return [
        alert(c, "SyncwatchGpuThrottlingOnStraggler",
              f"({throttled})\n* on (instance, uuid) group_left (train_job, rank, node)\n{straggler_gpus}",
              w.for_throttle, "warning",
              "The GPU of a straggling rank is throttling.",
              f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on node {NODE} throttles "
              f"({{{{ $labels.reason }}}}) while rank {RANK} of train job {JOB}, which runs on it, "
              f"is the persistent straggler: the throttling is the likely cause."),
        alert(c, "SyncwatchGpuThrottling",
              throttled, w.for_throttle, "info",
              "A GPU is throttling.",
              f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {INSTANCE} throttles "
              f"({{{{ $labels.reason }}}})."),
        alert(c, "SyncwatchGpuLost",
              "syncwatch_gpu_up == 0", w.for_gpu_lost, "critical",
              "A GPU stopped answering.",
              f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {INSTANCE} is lost, needs a "
              f"reset or is no longer listed by NVML (then under its last index, told apart by uuid); every "
              f"train job using it is stalled or dead."),
        alert(c, "SyncwatchGpuXidCritical",
              xid_recent(f'xid=~"{t.xid_critical}"'),
              w.for_xid, "critical",
              "A GPU reported a fatal XID error.",
              f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {INSTANCE} reported XID "
              f"{{{{ $labels.xid }}}} in the last {hw}: drain the node and reset or replace the GPU."),
        alert(c, "SyncwatchGpuXidError",
              xid_recent(f'xid!~"{t.xid_critical}"'),
              w.for_xid, "warning",
              "A GPU reported an XID error.",
              f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {INSTANCE} reported XID "
              f"{{{{ $labels.xid }}}} in the last {hw}."),
        alert(c, "SyncwatchNicLinkErrors",
              f"sum by (instance, device) (rate(syncwatch_nic_errors_total[{hw}])) > {t.nic_errors_per_s:g}\n"
              f"or\nsum by (instance, device) (increase(syncwatch_nic_carrier_changes_total[{hw}])) > 0",
              w.for_link_errors, "warning",
              "A network interface shows errors or a flapping link.",
              f"NIC {{{{ $labels.device }}}} on {INSTANCE} shows errors or carrier changes in the last "
              f"{hw}."),
        alert(c, "SyncwatchIbLinkErrors",
              f"sum by (instance, device, port) (\n  {ib_errors}\n) > 0",
              w.for_link_errors, "warning",
              "An InfiniBand port shows link errors.",
              f"InfiniBand port {{{{ $labels.device }}}}/{{{{ $labels.port }}}} on {INSTANCE} counted "
              f"{_num('%.0f')} link errors (symbol, receive, integrity, overrun, link down) in the "
              f"last {hw}."),
        alert(c, "SyncwatchFabricCongestion",
              f"sum by (instance, device, port) (rate(syncwatch_ib_port_xmit_wait_total[{c.d(w.rate)}])) "
              f"> {t.ib_xmit_wait_per_s:g}\nor\n"
              f"sum by (instance, device, port) (rate(syncwatch_roce_cnp_sent_total[{c.d(w.rate)}])) "
              f"> {t.roce_cnp_per_s:g}",
              w.for_fabric, "warning",
              "A fabric port is congested.",
              f"Port {{{{ $labels.device }}}}/{{{{ $labels.port }}}} on {INSTANCE} is congested "
              f"({_num('%.0f')}/s transmit-wait ticks or RoCE congestion notifications over "
              f"{c.d(w.rate)})."),
    ]


def exporter(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    r = c.d(w.rate)
    records = f"sum by (instance) (rate(syncwatch_ingest_records_total[{r}]))"
    # everything the daemon received, accepted or not
    offered = ('sum by (instance) (rate({__name__=~"syncwatch_ingest_records_total'
               f'|syncwatch_ingest_rejected_total"}}[{r}]))')
    dropped = f"sum by (instance) (rate(syncwatch_client_dropped_records_total[{r}]))"
    return [
        alert(c, "SyncwatchDaemonDown",
              f'up{{job="{t.scrape_job}"}} == 0', w.for_daemon_down, "warning",
              "A syncwatch node daemon cannot be scraped.",
              f"Prometheus cannot scrape the syncwatch daemon {INSTANCE}: the ranks of that node "
              f"are invisible (training itself is not affected)."),
        alert(c, "SyncwatchCollectorFailing",
              "syncwatch_collector_success == 0", w.for_collector, "warning",
              "A collector of a syncwatch daemon is failing.",
              f"Collector {{{{ $labels.collector }}}} of the syncwatch daemon {INSTANCE} fails; "
              f"its series are missing or stale."),
        alert(c, "SyncwatchIngestRejecting",
              f"sum by (instance, reason) (rate(syncwatch_ingest_rejected_total[{r}]))\n"
              f"/ on (instance) group_left\n{offered}\n> {t.ingest_reject_ratio:g}",
              w.for_ingest, "warning",
              "A syncwatch daemon rejects records.",
              f"The syncwatch daemon {INSTANCE} rejects {PCT} of incoming records with reason "
              f"{{{{ $labels.reason }}}}."),
        alert(c, "SyncwatchClientsDroppingRecords",
              f"{dropped}\n/\n({records}\n + {dropped})\n> {t.client_drop_ratio:g}",
              w.for_ingest, "warning",
              "Training ranks drop records before they reach the daemon.",
              f"Ranks reporting to {INSTANCE} dropped {PCT} of their records (daemon absent, "
              f"restarting or its socket queue full)."),
        alert(c, "SyncwatchWatchdog", "vector(1)", None, "info",
              "Always firing: proves the alerting pipeline works.",
              "This alert always fires. If the receiver stops getting it, Prometheus, its rules "
              "or Alertmanager are broken."),
    ]


ALERT_FILES = {
    "variance": variance,
    "stragglers": stragglers,
    "progress": progress,
    "restarts": restarts,
    "efficiency": efficiency,
    "hardware": hardware,
    "exporter": exporter,
}
