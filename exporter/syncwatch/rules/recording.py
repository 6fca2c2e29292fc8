"""Recording rules: raw syncwatch series -> per-train-job scores (``level:metric:operation``).

Where series come from (and why the joins look the way they do): per-rank series come from the
daemon of the rank's node (``instance`` = that daemon), job-level series (skew histogram, restarts,
re-runs, world size) from the daemon hosting global rank 0, GPU series carry ``gpu``/``uuid`` and
their daemon's ``instance``. ``syncwatch_rank_info{train_job,rank,local_rank,node,gpu,uuid,pid}``
joins them. Every aggregation is ``by (train_job ...)`` so ``instance`` never splits a job.

Rules of one group are evaluated in order, so a rule may use the records above it.
"""

from __future__ import annotations

from ..protocol import PAUSES
from .render import Ctx

SYNC_PHASE = 'syncwatch_phase_seconds_total{phase="sync"}'
PAUSE_PHASES = f'syncwatch_phase_seconds_total{{phase=~"{"|".join(PAUSES)}"}}'
RANK = "train_job, rank"  # per-rank aggregation: the instance (its node's daemon) never splits one
# One series per (train_job, rank) carrying the rank's node; topk keeps it unique while a
# restarted rank's previous process (other pid or node) is still within the daemon's rank TTL.
RANK_NODE = "topk by (train_job, rank) (1, syncwatch_rank_info)"


def started(window: str, indent: str = "") -> str:
    """The (train_job, rank) series of a rank whose process started within ``window``: its step
    counter reset there (a restart in place), or its series is younger than the window (rate()
    extrapolates its first value, and a new process's first step is its warm-up). Lines after
    the first start with ``indent``."""
    return (f"(\n{indent}  resets(syncwatch_steps_total[{window}]) > 0\n{indent}  or\n"
            f"{indent}  syncwatch_steps_total unless syncwatch_steps_total offset {window}\n{indent})")


def _component(name: str, value: str, ok: float, bad: float) -> dict:
    """One instability component: 0 at ``ok``, 1 at ``bad``, linear between, clamped to 0..1."""
    return {
        "record": "train_job:syncwatch_instability:component",
        "expr": f"clamp(({value} - {ok:g}) / {bad - ok:g}, 0, 1)",
        "labels": {"component": name},
    }


def recording_rules(c: Ctx) -> list[dict]:
    w, t = c.windows, c.thresholds
    r, rs, conc = c.d(w.rate), c.d(w.rate_short), c.d(w.concentration)

    # A denominator that can be 0 is filtered with "> 0" (which also drops NaN): a window without
    # steps or samples (a pause longer than the window) or without skew (the exchange runs every
    # K steps, minutes apart for slow steps) then has no value instead of NaN or +Inf. Those would
    # spread: through avg/stddev_over_time into the counter CV, the growths and the energy
    # baseline for up to 95m, and from any one component into the whole instability score; a
    # NaN or +Inf there never passes an alert threshold.
    def rate_by(metric: str, window: str, by: str = "train_job") -> str:
        return f"sum by ({by}) (rate({metric}[{window}]))"

    def delta_by(metric: str, window: str, by: str) -> str:
        """The rise of ``metric`` from its last sample a ``window`` ago to its last sample now,
        unextrapolated; only where no counter reset within (``started`` leaves those out)."""
        return f"sum by ({by}) ({metric} - {metric} offset {window})"

    def idle_by_rank(window: str) -> str:
        """Each rank's time off its compute, as the skew exchange compares it (instrument/monitor.py):
        its collective waits and its own planned pauses (0 where it reports none); none for a rank
        without a sync phase."""
        sync = rate_by(SYNC_PHASE, window, RANK)
        return f"(\n    {sync}\n    + ({rate_by(PAUSE_PHASES, window, RANK)} or 0 * {sync})\n  )"

    # The exact skew exchange's series decide, per job, where coupling, slack, last arrivals and
    # skew come from: a job that exported them in the last concentration window reads only them
    # (never a mixture of exact and estimated ranks, nor estimates while a restarted attempt
    # waits for its first exchange); any other job reads the estimates from window averages of
    # the waits (docs/rules.md, "Without the skew exchange").
    exact = f"group by (train_job) (present_over_time(syncwatch_slack_seconds_total[{conc}]))"
    slack_est = ("(\n  train_job_rank:syncwatch_sync_wait:mean5m\n  - on (train_job) group_left\n"
                 "  min by (train_job) (train_job_rank:syncwatch_sync_wait:mean5m)\n)")
    tie = ("(\n    (\n      train_job_rank:syncwatch_sync_wait:mean1m\n      - on (train_job) group_left\n"
           "      min by (train_job) (train_job_rank:syncwatch_sync_wait:mean1m)\n    )\n"
           f"    <= on (train_job) group_left\n"
           f"    {t.last_arrival_tie:g} * train_job:syncwatch_step_seconds:mean1m\n  )")

    h = c.d(w.restarts)
    executed = f"max by (train_job) (sum by (train_job, rank) (increase(syncwatch_steps_total[{h}])))"
    last_step = "syncwatch_last_step{0} and syncwatch_last_step_timestamp_seconds{0}"
    step_now = f"max by (train_job) ({last_step.format('')})"
    step_then = f"max by (train_job) ({last_step.format(f' offset {h}')})"

    rules = [
        # --- pace and throughput
        {"record": "train_job:syncwatch_steps:rate5m",
         "expr": f"avg by (train_job) (rate(syncwatch_steps_total[{r}]))"},
        {"record": "train_job:syncwatch_step_seconds:mean5m",
         "expr": f"{rate_by('syncwatch_step_seconds_total', r)}\n/\n({rate_by('syncwatch_steps_total', r)} > 0)"},
        # each rank's, less its checkpoint and eval phases (planned pauses, not jitter; the
        # daemon's step_cv reads the same), which are 0 where it reports none; the least
        # disturbed rank's, as for the CV (train_job:syncwatch_step_cv:min). Nor is a process's
        # first step, its warm-up, jitter (the daemon leaves it out of step_cv too): a window
        # that holds the start of one of the rank's processes (its counter reset, or a series
        # not a window old: rate() extrapolates its first value) has no value. A 10 s first
        # step among 0.5 s steps made one minute's mean 10 s after a restart in place, and the
        # counter CV 2.0 (bad at 0.035) for the next 10 minutes.
        # The three counters' changes over the minute are read between the same two scrapes
        # (``x - x offset 1m``), not with rate(): rate() extrapolates each counter to the window's
        # edges, except toward the start where that would take it below 0 (a job's first
        # checkpoint or evaluation: its counter from 0), so the first save's minute subtracted
        # less of it than the step time held: 0.79 s for 0.59 s steps at a 3 s save,
        # 4.9 s at a 15 s evaluation, and the counter CV was 1 (bad at 0.035) for 10 minutes.
        {"record": "train_job:syncwatch_step_seconds:mean1m",
         "expr": f"min by (train_job) (\n"
                 f"  (\n    {delta_by('syncwatch_step_seconds_total', rs, RANK)}\n"
                 f"    - ({delta_by(PAUSE_PHASES, rs, RANK)}\n"
                 f"       or 0 * {delta_by('syncwatch_step_seconds_total', rs, RANK)})\n  )\n"
                 f"  /\n  ({delta_by('syncwatch_steps_total', rs, RANK)} > 0)\n"
                 f"  unless on (train_job, rank)\n"
                 f"  {started(rs, indent='  ')}\n)"},
        {"record": "train_job:syncwatch_samples:rate5m",
         "expr": rate_by("syncwatch_samples_total", r)},
        {"record": "train_job:syncwatch_tokens:rate5m",
         "expr": rate_by("syncwatch_tokens_total", r)},
        # --- where the time goes
        {"record": "train_job:syncwatch_sync_tax:ratio5m",
         "expr": f"{rate_by(SYNC_PHASE, r)}\n/\n"
                 f"({rate_by('syncwatch_step_seconds_total', r)} > 0)"},
        {"record": "train_job_phase:syncwatch_phase:ratio5m",
         "expr": f"{rate_by('syncwatch_phase_seconds_total', r, 'train_job, phase')}\n"
                 f"/ on (train_job) group_left ()\n({rate_by('syncwatch_step_seconds_total', r)} > 0)"},
        # --- the fallback's inputs, for jobs without the exact skew exchange only (K = 0; a job
        # with it pays no series for them): each rank's mean wait per step, over 5m and 1m, its
        # own checkpoint and eval phases counted as waiting, as the exchange counts them. With the
        # sync phase alone, rank 0 saving alone (torch's DDP tutorial) while its peers waited for
        # it in the collective read as the last arrival by the whole save, its peers' wait for it
        # as slack and skew: 7.5 s saves every minute of 1 s steps made rank 0 a persistent
        # straggler (coupling 0.094) and the skew 12.5 % of the step (alerts/tests/fallback.test.yml);
        # 8 s every 100 steps read coupling 0.075, skew 8 %, rank 0 last in 29 % of the minutes.
        {"record": "train_job_rank:syncwatch_sync_wait:mean5m",
         "expr": f"(\n  {idle_by_rank(r)}\n  /\n"
                 f"  ({rate_by('syncwatch_steps_total', r, 'train_job, rank')} > 0)\n)\n"
                 f"unless on (train_job)\n{exact}"},
        {"record": "train_job_rank:syncwatch_sync_wait:mean1m",
         "expr": f"(\n  {idle_by_rank(rs)}\n  /\n"
                 f"  ({rate_by('syncwatch_steps_total', rs, 'train_job, rank')} > 0)\n)\n"
                 f"unless on (train_job)\n{exact}"},
        # A minute's last arrivals: the ranks whose mean wait is within last_arrival_tie of the
        # step of the smallest share it (1/n each), the others 0. One rank leading by a clear
        # margin takes the minute; healthy jitter spreads it over all ranks.
        {"record": "train_job_rank:syncwatch_last_arrival:estimate1m",
         "expr": f"(\n  0 * {tie} + 1\n)\n/ on (train_job) group_left\n"
                 f"count by (train_job) (\n  {tie}\n)\n"
                 f"or\n0 * train_job_rank:syncwatch_sync_wait:mean1m"},
        {"record": "train_job:syncwatch_coupling:ratio5m",
         "expr": f"{rate_by('syncwatch_slack_seconds_total', r)}\n/\n"
                 f"({rate_by('syncwatch_step_seconds_total', r)} > 0)\n"
                 f"or on (train_job)\n"
                 f"sum by (train_job) (\n  {slack_est.replace(chr(10), chr(10) + '  ')}\n"
                 f"  * on (train_job, rank)\n  {rate_by('syncwatch_steps_total', r, 'train_job, rank')}\n)\n"
                 f"/\n{rate_by('syncwatch_step_seconds_total', r)}"},
        {"record": "train_job_rank:syncwatch_slack:ratio5m",
         "expr": f"{rate_by('syncwatch_slack_seconds_total', r, 'train_job, rank')}\n/\n"
                 f"({rate_by('syncwatch_step_seconds_total', r, 'train_job, rank')} > 0)\n"
                 f"or on (train_job)\n"
                 f"{slack_est}\n"
                 f"/ on (train_job, rank)\n(\n"
                 f"  {rate_by('syncwatch_step_seconds_total', r, 'train_job, rank')}\n  /\n"
                 f"  {rate_by('syncwatch_steps_total', r, 'train_job, rank')}\n)"},
        # --- stragglers: who arrives last, and how concentrated that is
        {"record": "train_job_rank:syncwatch_last_arrival:ratio10m",
         "expr": f"(\n  {rate_by('syncwatch_last_arrivals_total', conc, 'train_job, rank')}\n  /\n"
                 f"  ({rate_by('syncwatch_steps_total', conc, 'train_job, rank')} > 0)\n"
                 f"  or on (train_job)\n"
                 f"  avg_over_time(train_job_rank:syncwatch_last_arrival:estimate1m[{conc}])\n"
                 f"  unless on (train_job)\n  {exact}\n)\n"
                 f"* on (train_job, rank) group_left (node)\n{RANK_NODE}"},
        {"record": "train_job:syncwatch_straggler_concentration:ratio10m",
         "expr": f"max by (train_job) ({rate_by('syncwatch_last_arrivals_total', conc, 'train_job, rank')})\n"
                 f"/\n({rate_by('syncwatch_last_arrivals_total', conc)} > 0)\n"
                 f"or on (train_job)\n"
                 f"(\n  max by (train_job) (train_job_rank:syncwatch_last_arrival:ratio10m)\n  /\n"
                 f"  (sum by (train_job) (train_job_rank:syncwatch_last_arrival:ratio10m) > 0)\n)\n"
                 f"unless on (train_job)\n{exact}"},
        # --- variance: per-step CV from the ranks' rolling windows, and from counters
        # the least disturbed rank's: the ranks of a synchronous job share one step time, each
        # less its own planned pauses; a rank that waited in a collective while a peer saved a
        # checkpoint or evaluated (rank 0 alone, as in torch's DDP tutorial) counts that wait as
        # its sync, and its CV held the job's far over the variance threshold
        {"record": "train_job:syncwatch_step_cv:min",
         "expr": "min by (train_job) (syncwatch_step_cv)"},
        {"record": "train_job:syncwatch_step_cv:avg5m",
         "expr": f"avg_over_time(train_job:syncwatch_step_cv:min[{r}])"},
        {"record": "train_job:syncwatch_step_cv:baseline",
         "expr": f"avg_over_time(train_job:syncwatch_step_cv:min[{c.d(w.baseline)}] "
                 f"offset {c.d(w.baseline_offset)})"},
        {"record": "train_job:syncwatch_step_cv:growth",
         "expr": f"train_job:syncwatch_step_cv:avg5m\n/\n"
                 f"clamp_min(train_job:syncwatch_step_cv:baseline, {t.cv_growth_floor:g})"},
        {"record": "train_job:syncwatch_step_cv:counters10m",
         "expr": f"stddev_over_time(train_job:syncwatch_step_seconds:mean1m[{c.d(w.cv_counters)}])\n/\n"
                 f"avg_over_time(train_job:syncwatch_step_seconds:mean1m[{c.d(w.cv_counters)}])"},
        # --- barrier skew (histogram from the daemon of global rank 0)
        # (without the exchange: the spread of the ranks' mean waits, a lower bound of the mean skew)
        {"record": "train_job:syncwatch_barrier_skew_seconds:mean5m",
         "expr": f"{rate_by('syncwatch_barrier_skew_seconds_sum', r)}\n/\n"
                 f"({rate_by('syncwatch_barrier_skew_seconds_count', r)} > 0)\n"
                 f"or on (train_job)\n"
                 f"max by (train_job) (train_job_rank:syncwatch_sync_wait:mean5m)\n"
                 f"- min by (train_job) (train_job_rank:syncwatch_sync_wait:mean5m)"},
        {"record": "train_job:syncwatch_barrier_skew_seconds:p99_5m",
         "expr": f"histogram_quantile(0.99, "
                 f"{rate_by('syncwatch_barrier_skew_seconds_bucket', r, 'train_job, le')})\n"
                 f"and on (train_job)\n({rate_by('syncwatch_barrier_skew_seconds_count', r)} > 0)"},
        {"record": "train_job:syncwatch_skew_step:ratio5m",
         "expr": "train_job:syncwatch_barrier_skew_seconds:mean5m\n/\n(train_job:syncwatch_step_seconds:mean5m > 0)"},
        # The baseline reads only windows that hold no start of a rank's process: a series younger
        # than the window is extrapolated at its start, the skew's and the step time's each their
        # own way, and a job's first windows read its skew/step up to a fifth low (0.079 for 0.1,
        # 30 s in at 15 s scrapes); 10 minutes into a job, when the baseline held only its first
        # minute, the skew growth of a job whose skew never changed read 1.36 (component 0.53, the
        # score alone over 0.5) at 10m30s, 1.25 at 11m.
        {"record": "train_job:syncwatch_skew_step:settled5m",
         "expr": f"train_job:syncwatch_skew_step:ratio5m\nunless on (train_job)\n{started(r)}"},
        {"record": "train_job:syncwatch_skew_step:baseline",
         "expr": f"avg_over_time(train_job:syncwatch_skew_step:settled5m[{c.d(w.baseline)}] "
                 f"offset {c.d(w.baseline_offset)})"},
        # The exact floor only for a job that was exact already when the baseline's range began:
        # a job with the exchange reads estimates until its first exchange, K = 50 steps (8
        # minutes of 10 s steps), and those are a fraction of the exact skew (healthy 8 ranks:
        # 0.0065 against 0.037 of the step). In the baseline they read exact skew against them,
        # growth 3.7 at the exact floor, the skew_growth component 1 from 15 to 25 minutes into a
        # healthy job, and with its first checkpoint's counter CV after it JobUnstable fired.
        {"record": "train_job:syncwatch_skew_step:growth",
         "expr": f"train_job:syncwatch_skew_step:ratio5m\n/\n(\n"
                 f"  clamp_min(train_job:syncwatch_skew_step:baseline, {t.skew_growth_floor:g})\n"
                 f"  and on (train_job)\n  {exact}\n"
                 f"  and on (train_job)\n  group by (train_job) (syncwatch_slack_seconds_total "
                 f"offset {c.d(w.baseline + w.baseline_offset)})\n"
                 f"  or on (train_job)\n"
                 f"  clamp_min(train_job:syncwatch_skew_step:baseline, {t.skew_growth_floor_estimate:g})\n)"},
        # --- oscillation: strongly negative lag-1 autocorrelation of step time
        {"record": "train_job:syncwatch_step_autocorrelation:avg",
         "expr": "avg by (train_job) (syncwatch_step_autocorrelation)"},
        {"record": "train_job:syncwatch_oscillation:avg5m",
         "expr": f"clamp_min(-avg_over_time(train_job:syncwatch_step_autocorrelation:avg[{r}]), 0)"},
        # --- restarts and re-run work (job-level counters). A daemon counts the restarts it sees
        # rank 0 make; a restart that moves rank 0 to another node is counted by neither daemon
        # (the new one meets the job at its new attempt), so the job's attempts in the window
        # count too, whichever daemons reported them: the larger of the two. Attempts, not how
        # far the number rose: under Slurm with torchrun inside, a requeue raises it by more than
        # one (instrument/identity.py). The attempts seen at each evaluation of the window
        # (a daemon reports an attempt of rank 0 for at least --rank-ttl). The daemons' counts
        # are rounded here and below: increase() extrapolates to the window's edges (a young
        # series' 2 restarts read 2.04)
        {"record": "train_job:syncwatch_restarts:increase1h",
         "expr": "max by (train_job) (\n"
                 "  label_replace(\n"
                 f"    round(sum by (train_job) (increase(syncwatch_job_restarts_total[{h}]))),\n"
                 '    "counted", "restarts", "", "")\n'
                 "  or\n"
                 "  label_replace(\n"
                 "    count by (train_job) (max_over_time(\n"
                 f'      (count_values by (train_job) ("attempt", syncwatch_job_attempt))[{h}:]\n'
                 "    )) - 1,\n"
                 '    "counted", "attempts", "", "")\n'
                 ")"},
        # Re-run steps: a daemon counts those of the restarts it counts (from the step numbers of
        # rank 0's old and new process), none of a restart that moved rank 0. Whatever the daemons
        # saw, the steps the job executed in the window less the progress of its step numbers
        # (n - (J_end - J_start) = the sum over restarts of old highest - new first + 1) count
        # them: rank 0's steps summed over its processes (a restart on another node is another
        # series), the job's step from ranks that completed one in their process (before its first
        # step a new process reports step 0), 0 where the job has no step an hour ago. The larger
        # of the two; the estimate's sampling error is at most one scrape interval of steps.
        {"record": "train_job:syncwatch_rerun_steps:increase1h",
         "expr": "max by (train_job) (\n"
                 "  label_replace(\n"
                 f"    round(sum by (train_job) (increase(syncwatch_job_rerun_steps_total[{h}]))),\n"
                 '    "counted", "daemons", "", "")\n'
                 "  or\n"
                 "  label_replace(\n"
                 f"    clamp_min(\n      {executed}\n      - on (train_job)\n"
                 f"      (\n        {step_now}\n        - on (train_job)\n"
                 f"        ({step_then} or on (train_job) 0 * {step_now})\n      ),\n    0),\n"
                 '    "counted", "steps", "", "")\n'
                 ")"},
        {"record": "train_job:syncwatch_rerun:ratio1h",
         "expr": f"clamp_max(train_job:syncwatch_rerun_steps:increase1h\n/\n({executed} > 0), 1)"},
        # --- efficiency: per-GPU (= per-rank) throughput against its own trailing baseline. Only
        # windows with samples count ("> 0"): the zeros of a stall, evaluation or checkpoint in the
        # trailing hour lowered the baseline (a 20m stall hid a halved throughput from
        # EfficiencyDrift), and a pause over the 70m the baseline then reached back made it 0 and
        # the ratio +Inf.
        {"record": "train_job:syncwatch_samples_per_gpu:rate5m",
         "expr": "(train_job:syncwatch_samples:rate5m > 0)\n/ on (train_job)\n"
                 "count by (train_job) (max by (train_job, rank) (syncwatch_rank_info))"},
        # The baseline reads only windows that hold no start of a rank's process: rate() over a
        # series younger than the window divides its increase by the whole window, so a job's
        # per-GPU rate ramps up over its first 5m (24 samples/s at 2m for 60), and those windows
        # held the baseline low for the job's first hour: a third less throughput 30 minutes in
        # read 0.72, rose over 0.8 after 28 minutes, and EfficiencyDrift never fired.
        # The baseline ends trailing_offset (35m) back, before the 30m for: and 5m rate window of
        # the alerts on it (thresholds.py): there is none in a job's first 40 minutes.
        {"record": "train_job:syncwatch_samples_per_gpu:settled5m",
         "expr": f"train_job:syncwatch_samples_per_gpu:rate5m\nunless on (train_job)\n{started(r)}"},
        {"record": "train_job:syncwatch_samples_per_gpu:baseline1h",
         "expr": f"avg_over_time(train_job:syncwatch_samples_per_gpu:settled5m[{c.d(w.trailing)}] "
                 f"offset {c.d(w.trailing_offset)})"},
        {"record": "train_job:syncwatch_efficiency:ratio_to_baseline",
         "expr": "train_job:syncwatch_samples_per_gpu:rate5m\n/\ntrain_job:syncwatch_samples_per_gpu:baseline1h"},
        # --- energy: GPU energy of the job's GPUs (joined by uuid) per sample
        # One GPU may have two series in the window: NVML, initialized again without a GPU that
        # fell off the bus, renumbers the GPUs after it (gpu="4" becomes gpu="3", same uuid), and
        # a restarted daemon may come back under another instance. The join then found duplicate
        # series on its one side and the rule failed for every job for 5m. The series follow
        # each other (a GPU is exported under one index at a time) and rate() divides each one's
        # increase by the whole window: their sum is the GPU's power (max read half of it
        # halfway through the window).
        {"record": "train_job:syncwatch_gpu_power:watts5m",
         "expr": f"sum by (train_job) (\n"
                 f"  sum by (uuid) (rate(syncwatch_gpu_energy_joules_total[{r}]))\n"
                 f"  * on (uuid) group_right\n"
                 f"  group by (train_job, uuid) (syncwatch_rank_info{{uuid!=\"\"}})\n)"},
        {"record": "train_job:syncwatch_energy_per_sample:joules5m",
         "expr": "train_job:syncwatch_gpu_power:watts5m\n/\n(train_job:syncwatch_samples:rate5m > 0)"},
        # the baseline as throughput's: the GPUs' energy counters are older than the job, its
        # young samples series' rate reads low, and its first 5m read energy per sample up to
        # twice what it was; in the baseline they hid 1.6x the energy per sample 30 minutes into
        # a job from EnergyOutpacingOutput (1.48 at 36m, at least 1.24 over the next 30m)
        {"record": "train_job:syncwatch_energy_per_sample:settled5m",
         "expr": f"train_job:syncwatch_energy_per_sample:joules5m\nunless on (train_job)\n{started(r)}"},
        {"record": "train_job:syncwatch_energy_per_sample:baseline1h",
         "expr": f"avg_over_time(train_job:syncwatch_energy_per_sample:settled5m[{c.d(w.trailing)}] "
                 f"offset {c.d(w.trailing_offset)})"},
        # --- instability: components (each 0..1) and their noisy-OR combination
        _component("cv", "train_job:syncwatch_step_cv:avg5m", t.inst_cv_ok, t.inst_cv_bad),
        _component("cv_counters", "train_job:syncwatch_step_cv:counters10m", t.inst_cv_counters_ok,
                   t.inst_cv_counters_bad),
        _component("cv_growth", "train_job:syncwatch_step_cv:growth", t.inst_growth_ok, t.inst_growth_bad),
        _component("skew", "train_job:syncwatch_skew_step:ratio5m", t.inst_skew_ok, t.inst_skew_bad),
        _component("skew_growth", "train_job:syncwatch_skew_step:growth", t.inst_skew_growth_ok,
                   t.inst_skew_growth_bad),
        _component("oscillation", "train_job:syncwatch_oscillation:avg5m", t.inst_osc_ok, t.inst_osc_bad),
        _component("rerun", "train_job:syncwatch_rerun:ratio1h", t.inst_rerun_ok, t.inst_rerun_bad),
        _component("restarts", "train_job:syncwatch_restarts:increase1h", t.inst_restarts_ok,
                   t.inst_restarts_bad),
        # 1 - prod(1 - c_i), written as a sum of logs so a missing component simply drops out.
        {"record": "train_job:syncwatch_instability:score",
         "expr": "1 - exp(sum by (train_job) (ln(1 - train_job:syncwatch_instability:component)))"},
    ]
    return rules
