"""The analysis commands against a real Prometheus holding backfilled counters of known value.

``test_analysis_e2e.py`` drives real daemons with the simulator; here the series are written
directly (``analysis_helpers.backfilled_prometheus``), so a range edge, a window width or a restart
can be placed to the second and the expected figures are exact.

Every rank completes one step a second (1 s step, 200 ms of it in sync, 50 ms slack), sampled
every 5 s, as if scraped.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from analysis_helpers import backfilled_prometheus, run_cli

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="prometheus / promtool missing (Debian package: prometheus)")

T0 = (int(time.time()) // 3600 - 3) * 3600  # well inside the default 15 d retention
SPAN = 2400                                  # seconds of data per job
SCRAPE = 5


def job_series(job: str, ranks: int = 4, ranks_per_node: int = 2, restarts: dict[float, int] | None = None):
    """Counters of one train job from T0 to T0 + SPAN; ``restarts``: {time: rerun steps}."""
    times = range(T0, T0 + SPAN + 1, SCRAPE)
    out = []
    for r in range(ranks):
        node = r // ranks_per_node
        lab = {"train_job": job, "rank": str(r), "instance": f"10.0.0.{node}:9477"}
        out.append(("syncwatch_rank_info", {**lab, "node": f"node-{node}", "local_rank": str(r % ranks_per_node)},
                    [(t, 1) for t in times]))
        for name, per_second in (("syncwatch_steps_total", 1.0), ("syncwatch_step_seconds_total", 1.0),
                                 ("syncwatch_slack_seconds_total", 0.05),
                                 ("syncwatch_last_arrivals_total", 1.0 if r == ranks - 1 else 0.0),
                                 ("syncwatch_samples_total", 8.0)):
            out.append((name, lab, [(t, (t - T0) * per_second) for t in times]))
        out.append(("syncwatch_phase_seconds_total", {**lab, "phase": "sync"}, [(t, (t - T0) * 0.2) for t in times]))
    if restarts is not None:
        lab = {"train_job": job, "instance": "10.0.0.0:9477"}
        out.append(("syncwatch_job_restarts_total", lab,
                    [(t, sum(1 for at in restarts if at <= t)) for t in times]))
        out.append(("syncwatch_job_rerun_steps_total", lab,
                    [(t, sum(n for at, n in restarts.items() if at <= t)) for t in times]))
    return out


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    series = job_series("steady")
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
