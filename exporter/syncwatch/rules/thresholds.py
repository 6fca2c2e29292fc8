"""Every threshold and window of the syncwatch rules, in one place.

Windows are in seconds. ``syncwatch rules render --time-scale F`` multiplies every window (range
selectors, offsets, ``for:`` durations, the stall allowance) by F, so the end-to-end test runs the
same rules minutes faster; thresholds are unitless or per-second and never scale. The committed
files in ``alerts/`` are rendered at scale 1 and are what ``promtool test rules`` checks.

Calibration of the instability score against the simulator: see docs/rules.md.
"""

from __future__ import annotations

from dataclasses import dataclass

MINUTE = 60.0
HOUR = 3600.0


@dataclass(frozen=True)
class Windows:
    rate: float = 5 * MINUTE            # the "5m" of the scores table
    rate_short: float = 1 * MINUTE      # short means feeding the counter-based CV
    concentration: float = 10 * MINUTE  # last-arrival shares (straggler identification)
    cv_counters: float = 10 * MINUTE    # CV of the short means, from counters
    baseline: float = 30 * MINUTE       # "earlier" step CV the growth compares against ...
    baseline_offset: float = 10 * MINUTE  # ... ending this long ago (a rise is not its own baseline)
    trailing: float = 1 * HOUR          # trailing baselines of throughput and energy per sample
    # ... ending this long ago: EfficiencyDrift's and EnergyOutpacingOutput's 30m for: + the 5m
    # rate window, so a change held through the for: is compared with the level before it. Ending
    # 10m back (baseline_offset), the baseline took in the change from 10m after its start: a 25 %
    # throughput drop read 0.83 35m in (1.3x the energy per sample 1.17), and neither alert fired.
    trailing_offset: float = 35 * MINUTE
    restarts: float = 1 * HOUR          # restarts and re-run ratio
    hardware: float = 10 * MINUTE       # error counter increases (NIC, IB), XIDs received
    desync: float = 5 * MINUTE          # a rank's collective sequence unchanged this long
    lost_lookback: float = 30 * MINUTE  # a rank seen this recently but gone now is lost
    # for: durations
    for_variance: float = 10 * MINUTE
    for_instability: float = 15 * MINUTE
    for_oscillation: float = 15 * MINUTE
    for_straggler: float = 10 * MINUTE
    for_skew: float = 15 * MINUTE
    for_coupling: float = 30 * MINUTE
    for_stall: float = 1 * MINUTE
    for_first_step: float = 30 * MINUTE  # live ranks with no step yet (a compile, a load is slow)
    for_desync: float = 2 * MINUTE
    for_lost: float = 2 * MINUTE
    for_restarts: float = 1 * MINUTE
    for_rerun: float = 5 * MINUTE
    for_efficiency: float = 30 * MINUTE
    for_energy: float = 30 * MINUTE
    for_throttle: float = 5 * MINUTE
    for_gpu_lost: float = 1 * MINUTE
    for_xid: float = 1 * MINUTE
    for_link_errors: float = 5 * MINUTE  # shorter than the hardware window, so one burst fires
    for_fabric: float = 10 * MINUTE
    for_daemon_down: float = 5 * MINUTE
    for_collector: float = 15 * MINUTE
    for_ingest: float = 15 * MINUTE
    # the stall allowance: no step for max(stall_factor x recent step time, stall_min)
    stall_min: float = 5 * MINUTE
    stall_memory: float = 30 * MINUTE   # how far back "recent step time" may come from
    # a rank in a planned pause, its checkpoint or eval phase (heartbeats), for less than this
    # is saving or evaluating, not stuck: the job is not stalled and the rank not desynchronized
    # (its peers wait in the next collective)
    pause_allowance: float = 30 * MINUTE


@dataclass(frozen=True)
class Thresholds:
    # variance (headline): CV above cv_page, or CV at least cv_growth_page x its own earlier CV
    cv_page: float = 0.15
    cv_growth_page: float = 2.0
    cv_growth_min: float = 0.05         # a rise only counts once the CV itself is this large
    cv_growth_floor: float = 0.02       # the earlier CV is floored here (no 10x of nothing)
    instability_warn: float = 0.5
    oscillation_warn: float = 0.5       # lag-1 autocorrelation below -0.5
    # stragglers and skew
    straggler_share: float = 0.6        # arrives last in >= 60 % of steps ...
    straggler_min_coupling: float = 0.05  # ... while peers idle >= 5 % of their time
    skew_step_warn: float = 0.1         # mean barrier skew >= 10 % of the step
    coupling_warn: float = 0.25         # a quarter of all rank-time idled waiting for peers
    # with the skew exchange off (K = 0): the ranks whose mean wait over a minute is within this
    # share of the step of the smallest share that minute's last arrivals. Healthy 1.5 % jitter
    # keeps all ranks within 0.3 % at ~50 steps a minute; the 8 % straggler leads by 6 %.
    last_arrival_tie: float = 0.02
    # progress
    stall_factor: float = 10.0          # x recent mean step time
    # restarts
    restarts_warn: float = 2            # restarts per restarts window
    restarts_crit: float = 5
    rerun_warn: float = 0.1             # re-run steps / steps executed
    # efficiency and energy
    efficiency_warn: float = 0.8        # per-GPU throughput below 80 % of its trailing baseline
    energy_warn: float = 1.25           # energy per sample 25 % above its trailing baseline
    # hardware
    # the collector's labels (collectors/gpu.py THROTTLE_REASONS), not its aggregate "thermal"
    # (sw_thermal or hw_thermal): with it each thermal event raised two alerts
    throttle_reasons: str = "sw_thermal|hw_thermal|hw_slowdown|power_brake|power_cap"
    xid_critical: str = "48|63|64|74|79|92|94|95|119|120"  # DBE, row remap, NVLink, fell off the bus, ...
    nic_errors_per_s: float = 1.0
    ib_xmit_wait_per_s: float = 1e6     # PortXmitWait ticks per second (congestion back-pressure)
    roce_cnp_per_s: float = 1000.0      # congestion notification packets sent per second
    # exporter self-health
    ingest_reject_ratio: float = 0.01
    client_drop_ratio: float = 0.01
    scrape_job: str = "syncwatch"       # Prometheus job name of the daemons' scrape config
    # instability score components: 0 at *_ok, 1 at *_bad, linear between, clamped
    inst_cv_ok: float = 0.05
    inst_cv_bad: float = 0.20
    inst_cv_counters_ok: float = 0.015  # CV of 1-minute mean step times over 10 minutes
    inst_cv_counters_bad: float = 0.035
    inst_growth_ok: float = 1.25
    inst_growth_bad: float = 3.0
    inst_skew_ok: float = 0.10          # jitter alone gives ~0.05 at 32 ranks, ~0.09 at 512
    inst_skew_bad: float = 0.25
    inst_skew_growth_ok: float = 1.2    # skew/step against the job's own earlier skew/step
    inst_skew_growth_bad: float = 1.5
    skew_growth_floor: float = 0.01     # the earlier skew/step is floored here
    # ... and here where skew is estimated from mean waits (exchange off): that estimate of a
    # healthy job is noise alone: ~0.01, from 0.007 to 0.015, at 26 steps per 5m window
    skew_growth_floor_estimate: float = 0.03
    inst_osc_ok: float = 0.2            # -autocorrelation; healthy noise sits near 0 +- 0.1 at W=100
    inst_osc_bad: float = 0.7
    inst_rerun_ok: float = 0.0
    inst_rerun_bad: float = 0.2
    # restarts in the last hour: bad at JobRestarting's level. One is ok: at 0 it made the
    # component 0.5, and the noisy-OR then passed 0.5 with anything else (its own re-runs), so
    # every job warned unstable for the hour after a single restart
    inst_restarts_ok: float = 1.0
    inst_restarts_bad: float = 2.0


RUNBOOK_BASE = "https://github.com/syncwatch/syncwatch/blob/main/docs/runbook.md"

WINDOWS = Windows()
THRESHOLDS = Thresholds()
