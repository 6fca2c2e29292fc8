"""The analysis commands against a real Prometheus holding backfilled counters of known value.

``test_analysis_e2e.py`` drives real daemons with the simulator; here the series are written
directly (``analysis_helpers.backfilled_prometheus``), so a range edge, a window width or a restart
can be placed to the second and the expected figures are exact.

Every rank completes one step a second (1 s step, 200 ms of it in sync, 50 ms slack), sampled
every 5 s, as if scraped.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from analysis_helpers import backfilled_prometheus, run_cli, victoriametrics
from syncwatch.analysis.orderstats import normal_max_moments
from syncwatch.analysis.prom import Prometheus
from syncwatch.analysis.view import from_prometheus, nearest_per_window

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="prometheus / promtool missing (Debian package: prometheus)")

T0 = (int(time.time()) // 3600 - 3) * 3600  # well inside the default 15 d retention
SPAN = 2400                                  # seconds of data per job
SCRAPE = 5


def job_series(job: str, ranks: int = 4, ranks_per_node: int = 2, restarts: dict[float, int] | None = None,
               daemon_restart: float | None = None, scrape: int = SCRAPE, step_times: bool = False,
               exchange: int = 0, slack: float = 0.05):
    """Counters of one train job from T0 to T0 + SPAN; ``restarts``: {time: rerun steps}.

    ``daemon_restart``: the rank-0 daemon restarts then, its job counters start again from zero.
    ``scrape``: seconds between samples; ``step_times``: with ``syncwatch_last_step_timestamp_seconds``;
    ``exchange``: the skew exchange's period in seconds (steps), its slack and last arrivals landing
    then, for the period before (0: smoothly, as if it landed at every step), with rank 0's skew
    histogram counting the exchanged steps; the last rank, which arrives last in every step, then
    idles never (its slack stays 0) and steps last. ``slack``: the other ranks' per step.
    """
    times = range(T0, T0 + SPAN + 1, scrape)
    out = []
    for r in range(ranks):
        node = r // ranks_per_node
        lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{node}:9477"}
        out.append(("syncwatch_rank_info", {**lab, "node": f"node-{node}", "local_rank": str(r % ranks_per_node)},
                    [(t, 1) for t in times]))
        straggler = r == ranks - 1
        for name, per_second in (("syncwatch_steps_total", 1.0), ("syncwatch_step_seconds_total", 1.0),
                                 ("syncwatch_slack_seconds_total", 0.0 if exchange and straggler else slack),
                                 ("syncwatch_last_arrivals_total", 1.0 if straggler else 0.0),
                                 ("syncwatch_samples_total", 8.0)):
            landed = exchange and name in ("syncwatch_slack_seconds_total", "syncwatch_last_arrivals_total")
            out.append((name, lab, [(t, ((t - T0) // exchange * exchange if landed else t - T0) * per_second)
                                    for t in times]))
        out.append(("syncwatch_phase_seconds_total", {**lab, "phase": "sync"}, [(t, (t - T0) * 0.2) for t in times]))
        if step_times:
            late = 0.5 if exchange and straggler else 0.0
            out.append(("syncwatch_last_step_timestamp_seconds", lab, [(t, t + late) for t in times]))
    if exchange:
        out.append(("syncwatch_barrier_skew_seconds_count", {"train_job": job, "instance": "10.0.0.0:9477"},
                    [(t, (t - T0) // exchange * exchange) for t in times]))
    if restarts is not None:
        lab = {"train_job": job, "instance": "10.0.0.0:9477"}
        since = [daemon_restart if daemon_restart is not None and t >= daemon_restart else -1 for t in times]
        out.append(("syncwatch_job_restarts_total", lab,
                    [(t, sum(1 for at in restarts if s < at <= t)) for t, s in zip(times, since)]))
        out.append(("syncwatch_job_rerun_steps_total", lab,
                    [(t, sum(n for at, n in restarts.items() if s < at <= t)) for t, s in zip(times, since)]))
    return out


def moved_job_series(job: str, fail: float = T0 + 1000, back: int = 300, gap: int = 20,
                     checkpoint_every: int = 0, checkpoint_seconds: float = 5.0):
    """Two ranks, one per node, steps numbered by the job: rank 0 on node 0 runs attempt 0 until
    ``fail``; the restart (``gap`` seconds later) puts it on node 1 as attempt 1, resuming ``back``
    steps before the failed step. Daemon 0 never hears rank 0 again and daemon 1 meets the job at
    attempt 1: both daemons' job counters stay 0. ``checkpoint_every``: rank 0 saves every so
    many seconds of each attempt, for ``checkpoint_seconds``, in its daemon's checkpoint counters
    (from 0 at each attempt: one series per daemon)."""
    out = []
    failed = int(fail - T0)
    for attempt, (first, last) in enumerate(((T0, fail), (fail + gap, T0 + SPAN))):
        times = range(int(first), int(last) + 1, SCRAPE)
        resume = failed - back if attempt else 0
        for r in range(2):
            node = (r + attempt) % 2
            lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{node}:9477"}
            out.append(("syncwatch_rank_info", {**lab, "node": f"node-{node}", "local_rank": "0"},
                        [(t, 1) for t in times]))
            for name, per_second in (("syncwatch_steps_total", 1.0), ("syncwatch_step_seconds_total", 1.0),
                                     ("syncwatch_slack_seconds_total", 0.05),
                                     ("syncwatch_last_arrivals_total", float(r)),
                                     ("syncwatch_samples_total", 8.0)):
                out.append((name, lab, [(t, (t - first) * per_second) for t in times]))
            out.append(("syncwatch_phase_seconds_total", {**lab, "phase": "sync"},
                        [(t, (t - first) * 0.2) for t in times]))
            out.append(("syncwatch_last_step", lab, [(t, resume + t - first) for t in times]))
            out.append(("syncwatch_last_step_timestamp_seconds", lab, [(t, t) for t in times]))
            if r == 0:
                job_lab = {"train_job": job, "instance": lab["instance"]}
                out.append(("syncwatch_job_attempt", job_lab, [(t, attempt) for t in times]))
                for name in ("syncwatch_job_restarts_total", "syncwatch_job_rerun_steps_total"):
                    out.append((name, job_lab, [(t, 0) for t in times]))
                if checkpoint_every:
                    saves = [(t, (t - first) // checkpoint_every) for t in times]
                    out.append(("syncwatch_checkpoints_total", job_lab, saves))
                    out.append(("syncwatch_checkpoint_seconds_total", job_lab,
                                [(t, n * checkpoint_seconds) for t, n in saves]))
    return out


def checkpointing_series(job: str, rank0_only: bool, every: int = 200, seconds: float = 10.0):
    """``job_series`` with two restarts and a checkpoint every ``every`` seconds taking ``seconds``:
    in every rank's ``phase="checkpoint"`` or, ``rank0_only`` (torch's DDP tutorial), in rank 0's
    alone, and in the rank-0 daemon's ``syncwatch_checkpoint_seconds_total`` and
    ``syncwatch_checkpoints_total`` either way."""
    out = job_series(job, restarts={T0 + 700: 50, T0 + 1500: 50})
    times = range(T0, T0 + SPAN + 1, SCRAPE)
    saves = [(t, (t - T0) // every) for t in times]
    for r in range(4):
        lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{r // 2}:9477", "phase": "checkpoint"}
        mine = r == 0 or not rank0_only
        out.append(("syncwatch_phase_seconds_total", lab, [(t, n * seconds if mine else 0.0) for t, n in saves]))
    lab = {"train_job": job, "instance": "10.0.0.0:9477"}
    out.append(("syncwatch_checkpoints_total", lab, saves))
    out.append(("syncwatch_checkpoint_seconds_total", lab, [(t, n * seconds) for t, n in saves]))
    return out


def rank0_saves_alone_series(job: str, every: int = 60, seconds: float = 7.5):
    """Four ranks without the skew exchange (no slack, no last arrivals), 1 s steps with 200 ms of
    sync; rank 0 alone saves ``seconds`` every ``every`` seconds (torch's DDP tutorial), in its
    ``phase="checkpoint"``, while the other three wait for it in the next collective: the save
    lands in their ``phase="sync"``."""
    times = range(T0, T0 + SPAN + 1, SCRAPE)
    out = []
    for r in range(4):
        lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{r // 2}:9477"}
        out.append(("syncwatch_rank_info", {**lab, "node": f"node-{r // 2}", "local_rank": str(r % 2)},
                    [(t, 1) for t in times]))
        for name in ("syncwatch_steps_total", "syncwatch_step_seconds_total"):
            out.append((name, lab, [(t, float(t - T0)) for t in times]))
        saved = [(t, (t - T0) // every * seconds) for t in times]
        out.append(("syncwatch_phase_seconds_total", {**lab, "phase": "checkpoint"},
                    [(t, s if r == 0 else 0.0) for t, s in saved]))
        out.append(("syncwatch_phase_seconds_total", {**lab, "phase": "sync"},
                    [(t, (t - T0) * 0.2 + (0.0 if r == 0 else s)) for t, s in saved]))
    return out


def autocorrelation_series(job: str, early: float, late: float):
    """``job_series`` with every rank's ``syncwatch_step_autocorrelation`` at ``early`` while its
    process has run up to 20 steps (T0 .. T0 + 20 s), at ``late`` after."""
    out = job_series(job)
    for r in range(4):
        lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{r // 2}:9477"}
        out.append(("syncwatch_step_autocorrelation", lab,
                    [(t, early if t - T0 <= 20 else late) for t in range(T0, T0 + SPAN + 1, SCRAPE)]))
    return out


def young_exchange_series(job: str, period: int = 20):
    """``job_series`` with the exchange every ``period`` s, its slack and last arrivals exported
    from the first landing on (T0 + period), as a daemon exports them: no sample before it."""
    landed = ("syncwatch_slack_seconds_total", "syncwatch_last_arrivals_total")
    return [(name, lab, [(t, v) for t, v in points if name not in landed or t >= T0 + period])
            for name, lab, points in job_series(job, exchange=period, step_times=True)]


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    series = [*job_series("steady"),
              *job_series("restarting", restarts={T0 + 302: 20, T0 + 1000: 30, T0 + 1800: 40}),
              *job_series("daemon-restart", restarts={T0 + 1000: 30, T0 + 1800: 40}, daemon_restart=T0 + 1400),
              *job_series("daemon-restart-then-restart", restarts={T0 + 1000: 30, T0 + 1200: 20, T0 + 1403: 40},
                          daemon_restart=T0 + 1401),
              *moved_job_series("moved"), *moved_job_series("moved-checkpointing", checkpoint_every=100),
              *job_series("scraped-15s", scrape=15),
              *job_series("scraped-30s", scrape=30, step_times=True),
              *job_series("exchange-20s", exchange=20, step_times=True),
              *job_series("straggler-12s", exchange=12, slack=0.195),
              *young_exchange_series("young-exchange"),
              *checkpointing_series("every-rank-saves", rank0_only=False),
              *checkpointing_series("rank-0-saves", rank0_only=True),
              *rank0_saves_alone_series("rank-0-saves-alone-no-exchange"),
              *autocorrelation_series("early-noise", -0.8, -0.1),
              *autocorrelation_series("oscillating", -0.8, -0.8)]
    with backfilled_prometheus(tmp_path_factory.mktemp("prom"), series) as p:
        yield p.url


def _diagnose(monkeypatch, capsys, url, job, start, end, *extra) -> dict:
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", url, "--job", job,
                                                 "--start", f"{start:.3f}", "--end", f"{end:.3f}",
                                                 "--json", *extra])
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("span", [960.0, 960.12])
def test_every_window_is_read_whatever_its_width(prom, span, monkeypatch, capsys):
    """960.12 s cut into 60 windows of 16.002 s: Prometheus read a step of "16.002" seconds as
    16.001 s, its answers' timestamps drifted off the windows, and all but the first window read as
    empty — the job seemed to have run 16 steps."""
    d = _diagnose(monkeypatch, capsys, prom, "steady", T0 + 300, T0 + 300 + span)
    assert d["steps"] == pytest.approx(span, rel=0.02)
    assert d["scores"]["mean_step_seconds"] == pytest.approx(1.0, rel=0.01)
    assert d["scores"]["sync_tax"] == pytest.approx(0.2, rel=0.01)
    assert d["scores"]["coupling"] == pytest.approx(0.05, rel=0.01)
    assert d["scores"]["collective_seconds"] == pytest.approx(0.15, rel=0.01)
    assert d["scores"]["straggler_concentration"] == 1.0  # the last rank arrives last every step


@pytest.mark.parametrize(("job", "start", "end"), [
    ("scraped-15s", T0 + 300, T0 + 1260),     # 16 s windows: most held one sample
    ("scraped-30s", T0 + 300, T0 + 1260),     # the rank that stepped last read at its last step
    ("scraped-30s", T0 + 1800, T0 + 3000),    # ... which is 10 minutes before the range end
])
def test_windows_hold_two_scrapes_whatever_the_window_asked(prom, job, start, end, monkeypatch, capsys):
    """With the shipped 15 s scrape interval, a 16-minute range was cut into 16 s windows: all but
    a few held a single sample, increase() read nothing there, and the job seemed to have run 128
    steps instead of 960; at a 30 s scrape interval every window was empty and the job "completed
    no steps (empty range)". The windows now span at least two and a half scrape intervals."""
    d = _diagnose(monkeypatch, capsys, prom, job, start, end)
    steps = min(end, T0 + SPAN) - start
    assert d["steps"] == pytest.approx(steps, rel=0.03)
    assert d["scores"]["mean_step_seconds"] == pytest.approx(1.0, rel=0.01)
    assert d["scores"]["coupling"] == pytest.approx(0.05, rel=0.01)


def test_windows_span_four_exchange_periods(prom, monkeypatch, capsys):
    """The exchange lands its slack every 20 s (K steps of 1 s), for the 20 steps before. In 15 s
    windows, each holding no landing or one, the collective time ((sync - slack) / steps) read
    0.2 and 0.133 s in turn about the true 0.15 s: episodes of a slower collective where there
    are none. The windows now span four exchange periods, measured from the slack's samples of
    several ranks: the straggler, which steps last, never idles, and its slack tells nothing."""
    view = from_prometheus(Prometheus(prom), "exchange-20s", T0 + 300, T0 + 900)
    assert view.window >= 4 * 20
    collective = 0.2 - 0.05 * 3 / 4  # the sync wait less the mean slack: three ranks idle
    assert all(x == pytest.approx(collective, rel=0.1) for x in view.collective_series() if x is not None)
    d = _diagnose(monkeypatch, capsys, prom, "exchange-20s", T0 + 300, T0 + 900)
    assert d["scores"]["coupling"] == pytest.approx(0.05 * 3 / 4, rel=0.05)
    assert "fabric_contention" not in [f["mode"] for f in d["findings"]]


def test_a_straggler_s_slack_is_taken_over_the_steps_it_covers(prom, monkeypatch, capsys):
    """A real 2-rank CPU job with rank 1 sleeping 30 ms per step: slack of 32 ms a step beside a
    1 ms collective. Its 20 s windows held 8 or 9 of the exchange's landings (50 steps each), and
    the collective time ((sync - slack) / steps) swung 0.3-2.2 ms (7.1x its baseline: fabric
    contention) where rank 1's own waits read 0.8-1.4 ms. Here: slack of 195 ms a step beside a
    5 ms collective, landing every 12 s in 40 s windows (3 or 4 landings). The slack now counts
    per exchanged step (rank 0's skew histogram count)."""
    view = from_prometheus(Prometheus(prom), "straggler-12s", T0 + 300, T0 + 900)
    collective = 0.2 - 0.195 * 3 / 4  # the sync wait less the mean slack: three ranks idle
    assert all(x == pytest.approx(collective, rel=0.1) for x in view.collective_series() if x is not None)
    d = _diagnose(monkeypatch, capsys, prom, "straggler-12s", T0 + 300, T0 + 900)
    assert [f["mode"] for f in d["findings"]] == ["straggler_persistent"]


def test_without_the_exchange_rank_0_saving_alone_is_no_straggler(prom, monkeypatch, capsys):
    """Estimated from the sync phase alone, rank 0 saving 7.5 s a minute while its peers waited
    for it in the collective read as the last arrival of every window holding a save, its peers'
    wait as slack: coupling 0.094. The skew exchange counts a rank's own pauses with its waits,
    and the rules' estimate does too: then every rank waits as long, no one straggles."""
    d = _diagnose(monkeypatch, capsys, prom, "rank-0-saves-alone-no-exchange", T0 + 300, T0 + 1500)
    assert "coupling" in d["estimated"]
    assert d["scores"]["coupling"] == pytest.approx(0.0, abs=0.005)
    assert not [f["mode"] for f in d["findings"] if f["mode"].startswith("straggler")]


def test_a_range_shorter_than_one_exchange_period_is_refused(prom, monkeypatch, capsys):
    """A job with the exchange on, read over 12 s between two of its landings: no slack and no
    last arrivals in range. It read as "exact skew exchange off", its coupling estimated from
    mean waits; it is refused with what to do instead. (It said the range was "shorter than one
    exchange period": a 3 s range at 2 s scrapes read that period as about 2 s; what the range
    lacks is two landings.)"""
    code, out, err = run_cli(monkeypatch, capsys, [
        "diagnose", "--prometheus", prom, "--job", "exchange-20s", "--start", f"{T0 + 302}",
        "--end", f"{T0 + 314}"])
    assert code == 2 and out == ""
    assert "once per exchange period (about 20 s)" in err and "widen the range" in err
    assert "Traceback" not in err


def test_a_job_younger_than_two_exchange_periods_is_refused_as_such(prom, monkeypatch, capsys):
    """A job started 35 s before the end of a 10-minute range (the demo read right after it
    started): one landing, which to Prometheus is a series' first sample, no increase. It was
    told "the range is shorter than one exchange period ... widen the range", which a wider range
    cannot help; it is told how little of the range the job ran, and to read it again later."""
    code, out, err = run_cli(monkeypatch, capsys, [
        "diagnose", "--prometheus", prom, "--job", "young-exchange", "--start", f"{T0 + 35 - 600}",
        "--end", f"{T0 + 35}"])
    assert code == 2 and out == ""
    assert "the job stepped in only about" in err and "read the job again" in err
    assert "widen the range" not in err and "Traceback" not in err
    ran = float(err.split("only about ")[1].split(" s")[0])
    assert 35 <= ran <= 35 + 600 / 10  # whole windows: at most one more


@pytest.mark.parametrize("span", [0.3, 0.999])
def test_a_sub_second_range_is_too_short(prom, span, monkeypatch, capsys):
    """A range under half a second was asked of Prometheus as ``[0s]``, and its HTTP 400 ("duration
    must be greater than 0") passed through as the error; one under a second holds no two scrapes."""
    code, out, err = run_cli(monkeypatch, capsys, [
        "diagnose", "--prometheus", prom, "--job", "steady", "--start", f"{T0 + 300}", "--end", f"{T0 + 300 + span}"])
    assert code == 2 and out == ""
    assert err == (f"syncwatch diagnose: error: time range too short: {span:.3g} s between --start and --end; "
                   "give at least 1 s, and a few scrape intervals for a reading (a counter's increase needs "
                   "two scrapes in range)\n")


def test_project_measures_the_counters(prom, monkeypatch, capsys):
    """``project`` from Prometheus measures what the counters hold: 2 nodes of 2 ranks, 1 s
    steps of 0.8 s compute, a 0.15 s collective (sync less slack) and 5 % coupling; its per-rank
    spread is the one whose expected maximum over 4 ranks is the 50 ms slack."""
    code, out, err = run_cli(monkeypatch, capsys, [
        "project", "--prometheus", prom, "--job", "steady", "--start", str(T0 + 300),
        "--end", str(T0 + 1260), "--json"])
    assert code == 0, err
    m = json.loads(out)["measured"]
    assert (m["nodes"], m["ranks"], m["steps"]) == (2, 4, 960)
    expected = {"mean_step": 1.0, "mean_compute": 0.8, "collective": 0.15, "coupling": 0.05,
                "samples_per_rank_step": 8.0, "sigma": 0.05 / normal_max_moments(4)[0]}
    assert {k: m[k] for k in expected} == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def victoria(tmp_path_factory):
    if shutil.which("victoria-metrics") is None:
        pytest.skip("victoria-metrics missing (Debian package: victoria-metrics)")
    series = [*job_series("steady"), *job_series("restarting", restarts={T0 + 302: 20, T0 + 1000: 30, T0 + 1800: 40})]
    with victoriametrics(tmp_path_factory.mktemp("vm"), series) as url:
        yield url


@pytest.mark.parametrize(("job", "start", "span"), [("steady", T0 + 307, 960.12), ("steady", T0 + 300, 960.0),
                                                    ("restarting", T0 + 300, 900.0)])
def test_victoriametrics_reads_as_prometheus(prom, victoria, job, start, span, monkeypatch, capsys):
    """VictoriaMetrics moves a range query's start down to a multiple of the step: its answers came
    up to a step before the window ends asked for, and every window read as empty ("completed no
    steps"). Its increase() does not extrapolate, hence the tolerance on the step count."""
    vm = _diagnose(monkeypatch, capsys, victoria, job, start, start + span)
    pr = _diagnose(monkeypatch, capsys, prom, job, start, start + span)
    assert vm["steps"] == pytest.approx(span, rel=0.02)
    for score in ("mean_step_seconds", "sync_tax", "coupling", "restarts", "rerun_steps"):
        assert vm["scores"][score] == pytest.approx(pr["scores"][score], rel=0.01), score
    assert [f["mode"] for f in vm["findings"]] == [f["mode"] for f in pr["findings"]]


def test_answers_on_a_grid_moved_earlier_are_read_into_the_nearest_window():
    """A backend aligning the range start to the step (Thanos' query frontend) answers at each
    window end less the same offset; exact matching read none of them."""
    times = [100.0 + 16 * (i + 1) for i in range(4)]                 # 116, 132, 148, 164
    assert nearest_per_window([(t, i) for i, t in enumerate(times)], times, 16) == [0, 1, 2, 3]
    assert nearest_per_window([(t - 4, i) for i, t in enumerate(times)], times, 16) == [0, 1, 2, 3]
    # moved by more than half a window: each point is nearer the next window's end; the first
    # (mostly before the range) is left out and the last window has no answer
    assert nearest_per_window([(t - 12, i) for i, t in enumerate(times)], times, 16) == [1, 2, 3, None]
    assert nearest_per_window([(times[0] - 12, 0)], times, 16) == [None] * 4
    assert nearest_per_window([(times[1], float("nan"))], times, 16) == [None] * 4


@pytest.mark.parametrize(("job", "start", "end", "restarts", "rerun"), [
    ("restarting", T0 + 300, T0 + 1200, 2, 50),   # the first restart 2 s into the first window
    ("restarting", T0 + 600, T0 + 1200, 1, 30),   # the first one before the range
    ("restarting", T0 + 1100, T0 + 1700, 0, 0),
    ("daemon-restart", T0 + 600, T0 + 2400, 2, 70),   # the counters fall to 0 between the two
    # the counters fall from 2 to 1: the new daemon saw a restart before its first scrape
    ("daemon-restart-then-restart", T0 + 600, T0 + 2400, 3, 90),
])
def test_restarts_in_range_from_the_range_start(prom, job, start, end, restarts, rerun, monkeypatch, capsys):
    """Restarts were counted from the end of the first window, so one inside it was missed (a
    range begun just before an incident read as healthy), and a reset counter subtracted. A
    counter that falls counts from zero again, as ``increase()``: where the restarted daemon
    counted a restart before its first scrape, that one is in range too."""
    d = _diagnose(monkeypatch, capsys, prom, job, start, end)
    assert (d["scores"]["restarts"], d["scores"]["rerun_steps"]) == (restarts, rerun)
    assert ("checkpoint_restart" in {f["mode"] for f in d["findings"]}) == (restarts > 0)


@pytest.mark.parametrize(("start", "end", "restarts"), [(T0 + 600, T0 + 2400, 1), (T0 + 1100, T0 + 2400, 0)])
def test_a_restart_that_moved_rank_0_to_another_node_is_counted(prom, start, end, restarts, monkeypatch, capsys):
    """Rank 0 moves from node 0 to node 1 at a restart that resumes 300 steps back: neither daemon
    counts it (their counters read 0 restarts and 0 re-run steps, and diagnose found nothing). The
    job's distinct attempts in range count the restart, and its executed steps less the progress of
    its step numbers the re-run steps (within a scrape interval of steps per series boundary)."""
    d = _diagnose(monkeypatch, capsys, prom, "moved", start, end)
    assert d["scores"]["restarts"] == restarts
    assert d["scores"]["rerun_steps"] == (pytest.approx(300, abs=2 * SCRAPE) if restarts else 0)
    assert ("checkpoint_restart" in {f["mode"] for f in d["findings"]}) == (restarts > 0)


@pytest.mark.parametrize(("job", "start", "found"), [("early-noise", T0, False), ("oscillating", T0, False),
                                                     ("oscillating", T0 + 600, True)])
def test_an_autocorrelation_over_a_process_s_first_steps_is_no_oscillation(prom, job, start, found,
                                                                           monkeypatch, capsys):
    """The daemons export a rank's step-time autocorrelation from its process's third step, where
    noise alone reads -0.5 or below in a fifth of the windows: the first 20 s of a job (or of a
    restart) reading -0.8 was an oscillation. A window's gauge counts once the rank's process ran
    more than 20 steps (``syncwatch_steps_total``); later, the same -0.8 is one."""
    d = _diagnose(monkeypatch, capsys, prom, job, start, start + 15)
    assert ("oscillation" in {f["mode"] for f in d["findings"]}) == found
    assert d["scores"]["step_autocorrelation"] == (pytest.approx(-0.8) if found else None)
    assert any("oscillation not assessed" in n for n in d["notes"]) != found


@pytest.mark.parametrize("job", ["every-rank-saves", "rank-0-saves"])
def test_a_checkpoint_costs_rank_0s_save_whichever_ranks_save(prom, job, monkeypatch, capsys):
    """A 10 s checkpoint every 200 s, two restarts. The cost per checkpoint was the checkpoint phase
    summed over all ranks, divided by the rank count and the checkpoints: where only rank 0 saves
    (torch's DDP tutorial) it read 2.5 s on 4 ranks, and Young's interval half its length. It is
    now rank 0's checkpoint time per checkpoint, as the rank-0 daemon counts them."""
    d = _diagnose(monkeypatch, capsys, prom, job, T0 + 60, T0 + SPAN - 60)
    (f,) = [f for f in d["findings"] if f["mode"] == "checkpoint_restart"]
    (cost,) = [e for e in f["evidence"] if "a checkpoint costs" in e["reading"]]
    assert cost["value"] == pytest.approx(10.0, rel=0.01)
    assert cost["series"] == "syncwatch_checkpoint_seconds_total / syncwatch_checkpoints_total"
    mtbf = float(cost["reading"].split("observed MTBF ")[1].split(" min")[0]) * 60
    assert mtbf == pytest.approx((SPAN - 120) / 2, rel=0.02)
    (young,) = [o for o in f["options"] if "Young's optimum" in o]
    interval = float(young.split(" = ")[1].split(" s ")[0])
    assert interval == pytest.approx(math.sqrt(2 * 10.0 * mtbf), abs=1)


PARTIAL = "partial response: store 10.0.0.7:10901 did not answer (context deadline exceeded)"


class _Warning(BaseHTTPRequestHandler):
    """Passes each request on to the real Prometheus and adds ``PARTIAL`` to its JSON answer's
    ``warnings``, as Thanos' querier does with partial responses on where a store did not answer."""

    def _relay(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if self.command == "POST" else None
        req = urllib.request.Request(self.server.upstream + self.path, data=body, method=self.command,
                                     headers={"Content-Type": self.headers.get("Content-Type", "")})
        with urllib.request.urlopen(req, timeout=30) as resp:
            answer = json.loads(resp.read())
        answer["warnings"] = [*answer.get("warnings", []), PARTIAL]
        out = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _relay

    def log_message(self, *args):
        pass


@pytest.fixture
def partial(prom):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Warning)
    srv.upstream = prom
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_partial_answer_is_noted_not_passed_off_as_whole(prom, partial, tmp_path, monkeypatch, capsys):
    """The same series answered with a warning (a partial response: some store's series missing)
    read as a whole answer: diagnose, project and report said nothing of it. Each now notes it,
    names the warning, and still reads the figures."""
    whole = _diagnose(monkeypatch, capsys, prom, "steady", T0 + 300, T0 + 900)
    d = _diagnose(monkeypatch, capsys, partial, "steady", T0 + 300, T0 + 900)
    note = (f"Prometheus at {partial} answered with warnings, so the figures may rest on partial data "
            f"(some series missing): {PARTIAL}")
    assert d["notes"][0] == note and note not in whole["notes"]
    assert d["scores"] == whole["scores"] and d["verdict"] == whole["verdict"]
    argv = ["--job", "steady", "--start", str(T0 + 300), "--end", str(T0 + 1260)]
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", partial, *argv])
    assert code == 0 and f"  note: {note}" in out.splitlines(), err
    code, out, err = run_cli(monkeypatch, capsys, ["project", "--prometheus", partial, *argv, "--json"])
    assert code == 0 and json.loads(out)["measured"]["notes"] == [note], err
    code, out, err = run_cli(monkeypatch, capsys, ["project", "--prometheus", partial, *argv])
    assert code == 0 and f"  note: {note}" in out.splitlines(), err
    html = tmp_path / "report.html"
    code, out, err = run_cli(monkeypatch, capsys, ["report", "--prometheus", partial, *argv, "--output", str(html)])
    assert code == 0 and PARTIAL in html.read_text(), err


def test_checkpoints_of_a_rank_0_that_moved_node_are_all_counted(prom, monkeypatch, capsys):
    """A 5 s checkpoint every 100 s of each attempt; the restart moves rank 0 from node 0 (10
    checkpoints) to node 1 (13), each daemon's counters a series of their own. The cost summed
    both series, the count took the larger: "a checkpoint costs 5.00 s (global rank 0's, 13 in
    range)" for the 23 the job wrote. Count and cost now read the same series."""
    d = _diagnose(monkeypatch, capsys, prom, "moved-checkpointing", T0, T0 + SPAN)
    (f,) = [f for f in d["findings"] if f["mode"] == "checkpoint_restart"]
    (cost,) = [e for e in f["evidence"] if "a checkpoint costs" in e["reading"]]
    assert cost["value"] == pytest.approx(5.0, rel=0.01)
    saved = int(cost["reading"].split("global rank 0's, ")[1].split(" in range")[0])
    assert saved == 1000 // 100 + (SPAN - 1000 - 20) // 100 == 23


# bcrypt of "s3cret" at cost 4 (cheap to check on every request), as Prometheus' web configuration
# takes it: python3 -c 'import crypt; print(crypt.crypt("s3cret", crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)))'
S3CRET_BCRYPT = "$2b$04$5itXJyRdHRYlCvDYdzTtn.TmNtBVb6oBiOJ.VX6GJHPTFTY69a6h."


@pytest.fixture(scope="module")
def auth_prom(tmp_path_factory):
    with backfilled_prometheus(tmp_path_factory.mktemp("prom-auth"), job_series("steady"),
                               web_config={"basic_auth_users": {"ann": S3CRET_BCRYPT}}) as p:
        yield p.url


def test_a_prometheus_asking_for_credentials_gets_them_from_flags_environment_or_url(
        auth_prom, tmp_path, monkeypatch, capsys):
    """There was no way to send credentials: a Prometheus behind basic auth answered every command
    with HTTP 401, and the message did not say what to do."""
    right, wrong = tmp_path / "right", tmp_path / "wrong"
    right.write_text("s3cret\n")
    wrong.write_text("guess\n")
    argv = ["diagnose", "--job", "steady", "--start", str(T0 + 300), "--end", str(T0 + 900), "--json"]
    code, out, err = run_cli(monkeypatch, capsys, [*argv, "--prometheus", auth_prom])
    assert code == 2 and not out
    assert err == (f"syncwatch diagnose: error: Prometheus at {auth_prom} answered HTTP 401 to /api/v1/query: "
                   "Unauthorized; it asks for credentials: give --prometheus-bearer-token-file, or "
                   "--prometheus-basic-auth-user with --prometheus-basic-auth-password-file\n")
    code, _, err = run_cli(monkeypatch, capsys, [*argv, "--prometheus", auth_prom, "--prometheus-basic-auth-user",
                                                 "ann", "--prometheus-basic-auth-password-file", str(wrong)])
    assert code == 2 and err.endswith("HTTP 401 to /api/v1/query: Unauthorized; the credentials given were not "
                                      "accepted\n")
    code, _, err = run_cli(monkeypatch, capsys, [*argv, "--prometheus", auth_prom,
                                                 "--prometheus-basic-auth-user", "ann"])
    assert code == 2 and "go together" in err

    by_flags = _diagnose(monkeypatch, capsys, auth_prom, "steady", T0 + 300, T0 + 900,
                         "--prometheus-basic-auth-user", "ann", "--prometheus-basic-auth-password-file", str(right))
    assert by_flags["steps"] == pytest.approx(600, rel=0.02)
    in_url = _diagnose(monkeypatch, capsys, auth_prom.replace("http://", "http://ann:s3cret@"), "steady",
                       T0 + 300, T0 + 900)
    monkeypatch.setenv("SYNCWATCH_PROMETHEUS_BASIC_AUTH_USER", "ann")
    monkeypatch.setenv("SYNCWATCH_PROMETHEUS_BASIC_AUTH_PASSWORD_FILE", str(right))
    by_env = _diagnose(monkeypatch, capsys, auth_prom, "steady", T0 + 300, T0 + 900)
    assert by_flags == in_url == by_env
