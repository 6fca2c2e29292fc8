"""The node daemon, end to end: real Unix / UDP sockets, real HTTP scrapes on loopback."""

from __future__ import annotations

import gzip
import math
import os
import random
import shutil
import signal
import socket
import stat
import statistics
import struct
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ROOT, subprocess_env
from daemon_helpers import (WALL0, Client, RankSim, healthz, identity, rss_of, scrape, scrape_text,
                            series_of, value, wait_for, wait_records)

from syncwatch.daemon import DaemonConfig, DaemonThread
from syncwatch.daemon.state import STEP_BUCKETS, SUPERSEDE_SECONDS, State
from syncwatch.protocol import (IDENT_FIXED, PHASES, REJECT_REASONS, SKEW_BUCKETS, Cumulative,
                                Decoder, Encoder, ProtocolError, SkewHistogram)
from syncwatch.sender import Sender


def config(sock_path, **kw) -> DaemonConfig:
    return DaemonConfig(listen="127.0.0.1:0", socket=sock_path, **kw)


@pytest.fixture
def daemon(sock_path):
    with DaemonThread(config(sock_path)) as d:
        yield d


@pytest.fixture
def client(daemon):
    c = Client(daemon.socket_path)
    yield c
    c.close()


def test_exported_totals_equal_what_was_sent(daemon, client):
    rng = random.Random(7)
    ranks = [RankSim(identity(r, world=4), tokens=True) for r in range(4)]
    step_sum = wait_sum = 0.0
    for step in range(1, 31):
        for sim in ranks:
            st, wt = rng.uniform(0.05, 0.3), rng.uniform(0.0, 0.02)
            step_sum, wait_sum = step_sum + st, wait_sum + wt
            client.send(sim.step(step, st, wt, slack=wt / 2, last_arrival=rng.random() < 0.25,
                                 samples=rng.choice((16, 32))))
    # Out of order and duplicate records of old steps change nothing.
    stale = RankSim(identity(1, world=4))
    client.send(stale.step(3, 9.0), stale.step(30, 9.0))
    wait_records(daemon.url, 122)
    m = scrape(daemon.url)
    for sim in ranks:
        t, lab = sim.totals, dict(train_job="job-a", rank=sim.ident.rank)
        assert value(m, "syncwatch_steps_total", **lab) == 30
        assert value(m, "syncwatch_step_seconds_total", **lab) == pytest.approx(t.step_seconds, rel=1e-12)
        for name, v in zip(PHASES, t.phase_seconds):
            assert value(m, "syncwatch_phase_seconds_total", phase=name, **lab) == pytest.approx(v, rel=1e-12)
        assert value(m, "syncwatch_slack_seconds_total", **lab) == pytest.approx(t.slack_seconds, rel=1e-12)
        assert value(m, "syncwatch_last_arrivals_total", **lab) == t.last_arrivals
        assert value(m, "syncwatch_samples_total", **lab) == t.samples
        assert value(m, "syncwatch_tokens_total", **lab) == t.tokens
        assert value(m, "syncwatch_last_step", **lab) == 30
        assert value(m, "syncwatch_last_step_timestamp_seconds", **lab) == WALL0 + 30
        assert value(m, "syncwatch_collective_sequence", **lab) == 60
    node = dict(train_job="job-a", node="node-1")
    assert value(m, "syncwatch_step_duration_seconds_count", **node) == 120
    assert value(m, "syncwatch_step_duration_seconds_sum", **node) == pytest.approx(step_sum)
    assert value(m, "syncwatch_sync_wait_seconds_count", **node) == 120
    assert value(m, "syncwatch_sync_wait_seconds_sum", **node) == pytest.approx(wait_sum)
    assert value(m, "syncwatch_step_duration_seconds_bucket", le=str(STEP_BUCKETS[0]), **node) == 0
    assert value(m, "syncwatch_ingest_records_total") == 122
    assert value(m, "syncwatch_ranks_active") == 4
    assert value(m, "syncwatch_job_world_size", train_job="job-a") == 4


def test_a_resent_last_step_brings_the_last_exchange_windows_totals(daemon, client):
    """At shutdown a rank sends its last step record again, with the skew exchange's last window
    in its totals. The daemon takes those totals (and rank 0's skew histogram) without counting
    the step twice; the first copy arriving late, or a plain duplicate, changes nothing. (The
    late copies were followed by the resent ones again before the one scrape: a late copy
    taken, its smaller totals or its older histogram, read as right.)"""
    import dataclasses
    sims = [RankSim(identity(r, world=2)) for r in range(2)]
    early = SkewHistogram(8, 0.4, tuple(0 if b < 0.05 else 8 for b in SKEW_BUCKETS))
    last = {}
    for step in range(1, 11):
        for sim in sims:
            skewed = (step, sim.ident.rank) == (10, 0)
            last[sim.ident.rank] = sim.step(step, 0.2, slack=0.01 * (step <= 5),
                                             last_arrival=step <= 5, skew=early if skewed else None)
            client.send(last[sim.ident.rank])
    # the last window: rank 1 waited for the others (slack, last arrivals), rank 0 did not
    sims[1].totals = dataclasses.replace(sims[1].totals, slack_seconds=sims[1].totals.slack_seconds
                                         + 0.04, last_arrivals=sims[1].totals.last_arrivals + 5)
    skew = SkewHistogram(10, 0.5, tuple(0 if b < 0.05 else 10 for b in SKEW_BUCKETS))
    again = [sim.enc.step(10, WALL0 + 10, 0.2, 0.001, (0.2 / len(PHASES),) * len(PHASES), 20, 32.0,
                          3200.0, sim.totals, exact=True, skew=skew if sim.ident.rank == 0 else None)
             for sim in sims]

    def assert_resent_taken(handled: int) -> None:
        wait_records(daemon.url, handled)
        m = scrape(daemon.url)
        for r, slack, arrivals in ((0, 0.05, 5), (1, 0.09, 10)):
            lab = dict(train_job="job-a", rank=r)
            assert value(m, "syncwatch_slack_seconds_total", **lab) == pytest.approx(slack), r
            assert value(m, "syncwatch_last_arrivals_total", **lab) == arrivals, r
            assert value(m, "syncwatch_steps_total", **lab) == 10
        node = dict(train_job="job-a", node="node-1")
        assert value(m, "syncwatch_step_duration_seconds_count", **node) == 20  # no step twice
        assert value(m, "syncwatch_barrier_skew_seconds_count", train_job="job-a") == 10
        assert value(m, "syncwatch_barrier_skew_seconds_sum", train_job="job-a") == 0.5

    client.send(*again, last[0], last[1])  # the first copies arrive late
    assert_resent_taken(24)
    client.send(*again)  # plain duplicates
    assert_resent_taken(26)


def test_step_cv_and_autocorrelation_over_the_window(sock_path):
    rng = random.Random(3)
    durations = [rng.uniform(0.1, 0.2) * (1.5 if i % 2 else 1.0) for i in range(25)]
    with DaemonThread(config(sock_path, window=10)) as d:
        sim, c = RankSim(identity(0)), Client(d.socket_path)
        c.send(*(sim.step(i + 1, x) for i, x in enumerate(durations)))
        wait_records(d.url, 25)
        m = scrape(d.url)
    w = durations[-10:]
    mean = sum(w) / len(w)
    dev = [x - mean for x in w]
    lag1 = sum(dev[i] * dev[i + 1] for i in range(9)) / sum(e * e for e in dev)
    assert value(m, "syncwatch_step_cv", train_job="job-a", rank=0) == pytest.approx(
        statistics.pstdev(w) / statistics.mean(w), rel=1e-9)
    ac = value(m, "syncwatch_step_autocorrelation", train_job="job-a", rank=0)
    assert ac == pytest.approx(lag1, rel=1e-9)
    assert ac < -0.5  # the alternating pattern reads as oscillation


def _tail_cv(xs, seconds, least=4):
    """The CV of the latest of ``xs`` that add up to at most ``seconds`` (at least ``least``)."""
    n = least
    while n < len(xs) and sum(xs[-(n + 1):]) <= seconds:
        n += 1
    tail = xs[-n:]
    return statistics.pstdev(tail) / statistics.mean(tail)


def _working(sim, step, seconds):
    """A step record whose time is all work (no checkpoint or eval, which the CV leaves out)."""
    return sim.step(step, seconds, phases=(seconds,) + (0.0,) * (len(PHASES) - 1))


def test_step_cv_is_over_the_last_cv_seconds_of_steps_so_one_stall_leaves_it(sock_path):
    """At 10 s steps a CV over W = 100 steps held one 30 s stall for 17 minutes, past the
    variance alert's 10m: one stall paged. The CV is over the steps of the last 240 s (at least
    4); the autocorrelation still over all W."""
    rng = random.Random(11)
    before = [rng.uniform(9.8, 10.2) for _ in range(40)]
    after = [rng.uniform(9.8, 10.2) for _ in range(30)]
    durations = before + [30.0] + after
    with DaemonThread(config(sock_path, window=100)) as d:
        sim, c = RankSim(identity(0)), Client(d.socket_path)
        c.send(_working(sim, 1, 10.0), *(_working(sim, i + 2, x) for i, x in enumerate(durations[:45])))
        wait_records(d.url, 46)
        with_stall = value(scrape(d.url), "syncwatch_step_cv", train_job="job-a", rank=0)
        c.send(*(_working(sim, i + 47, x) for i, x in enumerate(durations[45:])))
        wait_records(d.url, 72)
        m = scrape(d.url)
    assert with_stall == pytest.approx(_tail_cv(durations[:45], 240.0), rel=1e-9)
    assert with_stall > 0.25            # 30 s among 10 s steps: well over the page's 0.15
    cv = value(m, "syncwatch_step_cv", train_job="job-a", rank=0)
    assert cv == pytest.approx(_tail_cv(durations, 240.0), rel=1e-9)
    assert 30.0 not in durations[-24:] and cv < 0.02  # 24 steps (240 s) later the stall is out
    assert statistics.pstdev(durations) / statistics.mean(durations) > 0.15  # W would hold it
    dev = [x - statistics.mean(durations) for x in durations]
    assert value(m, "syncwatch_step_autocorrelation", train_job="job-a", rank=0) == pytest.approx(
        sum(a * b for a, b in zip(dev, dev[1:])) / sum(e * e for e in dev), rel=1e-9)


@pytest.mark.parametrize("cv_seconds, step, steps", [(240.0, 100.0, 4), (math.inf, 10.0, 30),
                                                     (240.0, 0.5, 30)])
def test_step_cv_holds_at_least_4_steps_and_at_most_the_window(sock_path, cv_seconds, step, steps):
    """Steps slower than a quarter of --cv-seconds: the last 4. --cv-seconds inf, or fast steps:
    every step of the window."""
    rng = random.Random(12)
    durations = [step * rng.uniform(0.9, 1.1) for _ in range(30)]
    with DaemonThread(config(sock_path, window=100, cv_seconds=cv_seconds)) as d:
        sim, c = RankSim(identity(0)), Client(d.socket_path)
        c.send(_working(sim, 1, step), *(_working(sim, i + 2, x) for i, x in enumerate(durations)))
        wait_records(d.url, 31)
        m = scrape(d.url)
    tail = durations[-steps:]
    assert value(m, "syncwatch_step_cv", train_job="job-a", rank=0) == pytest.approx(
        statistics.pstdev(tail) / statistics.mean(tail), rel=1e-9)


def test_step_cv_leaves_each_process_s_first_step_out(sock_path):
    """A process's first step is its warm-up (setup, a checkpoint load, compilation): 60 s before
    5 s steps would read CV ~1 for the whole window. The CV reads the steps after it; a
    restarted process's first step is left out too; the totals keep every step."""
    rng = random.Random(5)
    steady = [rng.uniform(4.9, 5.1) for _ in range(20)]
    with DaemonThread(config(sock_path, window=100)) as d:
        c = Client(d.socket_path)
        sim = RankSim(identity(0))
        c.send(sim.step(1, 60.0), *(sim.step(i + 2, x) for i, x in enumerate(steady)))
        wait_records(d.url, 21)
        m = scrape(d.url)
        cv = value(m, "syncwatch_step_cv", train_job="job-a", rank=0)
        assert cv == pytest.approx(statistics.pstdev(steady) / statistics.mean(steady), rel=1e-9)
        assert cv < 0.02
        assert value(m, "syncwatch_step_seconds_total", train_job="job-a", rank=0) == \
            pytest.approx(60.0 + sum(steady))
        restarted = RankSim(identity(0, pid=4242))  # a new process: fresh state, its own warm-up
        c.send(restarted.step(11, 90.0), *(restarted.step(i + 12, x) for i, x in enumerate(steady[:5])))
        wait_records(d.url, 27)
        m = scrape(d.url)
    assert value(m, "syncwatch_step_cv", train_job="job-a", rank=0) == pytest.approx(
        statistics.pstdev(steady[:5]) / statistics.mean(steady[:5]), rel=1e-9)


def test_step_cv_leaves_the_planned_pauses_out(sock_path):
    """Steps of 0.1 s with a 5 s checkpoint every 7th and a 3 s evaluation every 5th: the CV and
    autocorrelation read the steps less their checkpoint and eval phases (planned pauses, not
    jitter); the step counters and the step-duration histogram keep the whole step."""
    rng = random.Random(5)
    paced = [rng.uniform(0.09, 0.11) for _ in range(30)]
    ckpt = [5.0 if i % 7 == 6 else 0.0 for i in range(30)]
    ev = [3.0 if i % 5 == 4 else 0.0 for i in range(30)]
    with DaemonThread(config(sock_path, window=20)) as d:
        sim, c = RankSim(identity(0)), Client(d.socket_path)
        c.send(*(sim.step(i + 1, x + k + e, phases=(0.02, 0.03, x - 0.05, 0.0, 0.0, k, 0.0, e))
                 for i, (x, k, e) in enumerate(zip(paced, ckpt, ev))))
        wait_records(d.url, 30)
        m = scrape(d.url)
    w = paced[-20:]
    cv = value(m, "syncwatch_step_cv", train_job="job-a", rank=0)
    assert cv == pytest.approx(statistics.pstdev(w) / statistics.mean(w), rel=1e-9)
    assert cv < 0.1  # with the pauses counted in it would be ~3
    assert value(m, "syncwatch_step_seconds_total", train_job="job-a", rank=0) == pytest.approx(
        sum(paced) + sum(ckpt) + sum(ev))
    assert value(m, "syncwatch_phase_seconds_total", train_job="job-a", rank=0,
                 phase="checkpoint") == pytest.approx(sum(ckpt))
    assert value(m, "syncwatch_phase_seconds_total", train_job="job-a", rank=0,
                 phase="eval") == pytest.approx(sum(ev))


def _valid_step() -> bytes:
    return RankSim(identity(5)).step(1, 0.1)


def _bad_identity() -> bytes:
    """A well-formed record whose identity says rank 9 of a world of 4."""
    good = _valid_step()
    ident_len = struct.unpack_from("<H", good, 4)[0]
    ident = IDENT_FIXED.pack(9, 1, 4, 0, -1, 77, 1) + good[6 + IDENT_FIXED.size:6 + ident_len]
    return good[:6] + ident + good[6 + ident_len:]


BAD_INPUT = {
    "too_large": [b"SW" + b"\x00" * 3000],
    "truncated": [b"", b"S", _valid_step()[:-3]],
    "bad_magic": [b"XX" + _valid_step()[2:], bytes(random.Random(1).randrange(256) | 1 for _ in range(64))],
    "unknown_version": [_valid_step()[:2] + b"\x07" + _valid_step()[3:]],
    "unknown_kind": [_valid_step()[:3] + b"\x09" + _valid_step()[4:]],
    "unknown_fields": [_valid_step() + b"\x00"],
    "bad_identity": [_bad_identity()],
    "bad_value": [RankSim(identity(6)).step(1, float("nan")), RankSim(identity(7)).step(1, -1.0),
                  RankSim(identity(8)).step(1, 5e7)],
}


def test_bad_input_is_rejected_by_reason_and_scrape_stays_ok(daemon, client):
    n = sum(len(v) for v in BAD_INPUT.values())
    for datagrams in BAD_INPUT.values():
        client.send(*datagrams)
    client.send(_valid_step())
    wait_records(daemon.url, n + 1)
    m = scrape(daemon.url)
    for reason, datagrams in BAD_INPUT.items():
        assert value(m, "syncwatch_ingest_rejected_total", reason=reason) == len(datagrams), reason
    assert value(m, "syncwatch_ingest_records_total") == 1
    assert value(m, "syncwatch_ranks_active") == 1
    assert {dict(k[1])["reason"] for k in m if k[0] == "syncwatch_ingest_rejected_total"} == set(REJECT_REASONS)


def test_too_large_datagram_over_udp_is_counted(sock_path, caplog):
    """Its log line said "2049 bytes > 2048" whatever the datagram's size (the reader takes one
    byte more than the limit, and the rest is gone): 5000 bytes read as one too many."""
    caplog.set_level("WARNING", logger="syncwatch.daemon")
    with DaemonThread(config(sock_path, udp="127.0.0.1:0")) as d:
        host, port = d.udp_address.rsplit(":", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"SW" + b"\x00" * 5000, (host, int(port)))
        s.sendto(_valid_step(), (host, int(port)))
        wait_records(d.url, 2)
        m = scrape(d.url)
    assert value(m, "syncwatch_ingest_rejected_total", reason="too_large") == 1
    assert value(m, "syncwatch_ingest_records_total") == 1
    assert [r.getMessage() for r in caplog.records if "too_large" in r.getMessage()] == [
        "rejected record: too_large: more than 2048 bytes"]


def _daemon_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "syncwatch", "daemon", *flags]


def _start_cli_daemon(sock_path, *flags):
    proc = subprocess.Popen(_daemon_cmd("--listen", "127.0.0.1:0", "--socket", sock_path,
                                        "--log-level", "error", *flags),
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(sock_path) or proc.poll() is not None, 30, "daemon socket")
    import psutil
    port = wait_for(lambda: [c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp")
                             if c.status == "LISTEN"], 30, "daemon port")[0]
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["ranks", "jobs"])
def test_cardinality_bomb_is_bounded(sock_path, kind):
    proc, url = _start_cli_daemon(sock_path, "--max-ranks", "256", "--max-jobs", "8")
    try:
        c = Client(sock_path)
        c.send(RankSim(identity(0, job="warm-up")).step(1, 0.1))  # takes one rank and one job slot
        wait_records(url, 1)
        scrape(url)
        rss_before = rss_of(proc.pid)
        for i in range(10_000):
            ident = identity(i, world=20000, pid=50_000 + i) if kind == "ranks" else \
                identity(0, job=f"bomb-{i}", pid=50_000 + i)
            c.send(Encoder(ident).heartbeat(WALL0, 0, 0.0, "data", 0.5, 0))
        wait_records(url, 10_001, timeout=60)
        m = scrape(url)
        rss_after = rss_of(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    accepted_ranks = 256 if kind == "ranks" else 8
    reason = "rank_limit" if kind == "ranks" else "job_limit"
    assert value(m, "syncwatch_ingest_rejected_total", reason=reason) == 10_000 - (accepted_ranks - 1)
    assert value(m, "syncwatch_ranks_active") == accepted_ranks
    per_rank = [k for k in m if dict(k[1]).get("rank") is not None]
    assert len(per_rank) <= 25 * accepted_ranks
    assert len(m) < 25 * accepted_ranks + 200
    # Generous: 256 small rank states and a bounded identity cache are a few MB.
    assert rss_after - rss_before < 40 << 20, (rss_before, rss_after)


def _full_exposition(daemon, client, ranks=4):
    sims = [RankSim(identity(r, world=ranks), tokens=True) for r in range(ranks)]
    skew = SkewHistogram(2, 0.003, tuple(0 if b < 0.001 else 2 for b in SKEW_BUCKETS))
    for step in (1, 2, 3, 4):  # the first is left out of the CV: three for the autocorrelation
        for sim in sims:
            client.send(sim.step(step, 0.1 * step, checkpoint=step == 2,
                                 skew=skew if sim.ident.rank == 0 else None))
    for sim in sims:
        client.send(sim.enc.heartbeat(WALL0 + 5, 4, WALL0 + 4, "sync", 1.5, 7))
    wait_records(daemon.url, 5 * ranks)


def test_each_node_name_costs_the_series_the_docs_say(sock_path):
    """docs/deploy.md sized the series as if a node's ranks always shared its name: ranks that
    report node names of their own (pods or containers not told the machine's name) each bring
    the two histograms, which at --max-ranks 1024 made 91,177 series instead of 21,613, and
    neither deploy.md nor daemon.md said so. What one more node name costs is what they say."""
    series = {}
    for own in (False, True):
        with DaemonThread(config(sock_path)) as d:
            c = Client(d.socket_path)
            c.send(*(RankSim(identity(r, world=8, node=f"pod-{r}" if own else "node-1"))
                     .step(1, 0.2, wait_seconds=0.01) for r in range(8)))
            wait_records(d.url, 8)
            series[own] = len(scrape(d.url))
    per_name, rest = divmod(series[True] - series[False], 7)
    assert (per_name, rest) == (68, 0), series
    deploy, daemon_md = ((ROOT / "docs" / name).read_text() for name in ("deploy.md", "daemon.md"))
    assert f"two histograms ({per_name} series) are kept per job and\n*node name*" in deploy
    assert f"plus {per_name} per job and node name" in daemon_md


def test_node_histograms_follow_the_ranks_not_every_node_label_ever_seen(sock_path):
    """A rank whose node label changes with every new process (a pod name, without NODE_NAME)
    must not leave a histogram pair behind per label: they were bounded by nothing."""
    with DaemonThread(config(sock_path, max_ranks=4, job_grace=30)) as d:
        c = Client(d.socket_path)
        steady = [RankSim(identity(r, node="node-1")) for r in (0, 1)]
        c.send(*(s.step(1, 0.2, wait_seconds=0.01) for s in steady))
        for i in range(500):  # rank 2 restarts 500 times, each time in a new pod
            c.send(RankSim(identity(2, node=f"pod-{i}", pid=10_000 + i)).step(1, 0.3))
        wait_records(d.url, 502)
        m = scrape(d.url)
        nodes = {dict(k[1])["node"] for k in m if k[0] == "syncwatch_step_duration_seconds_count"}
        assert nodes == {"node-1", "pod-499"}
        assert len([k for k in m if k[0].startswith("syncwatch_")]) < 300
        node1, pod = dict(train_job="job-a", node="node-1"), dict(train_job="job-a", node="pod-499")
        assert value(m, "syncwatch_step_duration_seconds_count", **node1) == 2
        assert value(m, "syncwatch_step_duration_seconds_sum", **node1) == pytest.approx(0.4)
        assert value(m, "syncwatch_sync_wait_seconds_sum", **node1) == pytest.approx(0.02)
        assert value(m, "syncwatch_step_duration_seconds_count", **pod) == 1
        # Ranks that end keep the job's histograms through the grace period.
        c.send(*(s.enc.end(WALL0 + 2, 1) for s in steady))
        wait_records(d.url, 504)
        assert value(scrape(d.url), "syncwatch_step_duration_seconds_count", **node1) == 2


def test_scrapes_that_arrive_during_a_render_share_it(sock_path, monkeypatch):
    """Renders queued one per request: scrapes their clients had given up on still rendered one
    after another (40 abandoned scrapes of a 0.4 s render held the next one past Prometheus' 10 s
    timeout). A scrape that arrives while a render of its format is under way now gets that
    render: 12 scrapes at once of a render slowed to 0.5 s make one render per format (at most
    two, for one that arrives late on a busy machine), not 12."""
    import concurrent.futures
    import syncwatch.daemon.app as app_mod
    renders = []
    real = app_mod.render

    def slow_render(registry, accept, gzipped):
        renders.append((accept, gzipped))
        time.sleep(0.5)
        return real(registry, accept, gzipped)

    monkeypatch.setattr(app_mod, "render", slow_render)
    with DaemonThread(config(sock_path)) as d:
        Client(d.socket_path).send(RankSim(identity(0)).step(1, 0.1))
        wait_records(d.url, 1)

        def scrape_as(gzipped: bool) -> bytes:
            req = urllib.request.Request(d.url + "/metrics",
                                         headers={"Accept-Encoding": "gzip"} if gzipped else {})
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
            return gzip.decompress(body) if gzipped else body

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            bodies = list(pool.map(scrape_as, [i % 2 == 0 for i in range(12)]))
    assert len(set(bodies)) == 1 and b"syncwatch_steps_total" in bodies[0]
    assert len(renders) <= 4 and {g for _, g in renders} == {False, True}, renders


def test_a_burst_of_rejects_is_logged_whole_once_it_is_over(sock_path, monkeypatch, caplog):
    """Rejects are logged once per reason per interval, the rest counted: the count was told
    only with the next reject of that reason, so a burst that ended was never logged whole."""
    import syncwatch.daemon.ingest as ingest_mod
    monkeypatch.setattr(ingest_mod, "REJECT_LOG_EVERY", 0.5)
    caplog.set_level("WARNING", logger="syncwatch.daemon")
    with DaemonThread(config(sock_path)) as d:
        Client(d.socket_path).send(*[b"garbage"] * 5)
        wait_records(d.url, 5)
        wait_for(lambda: any("more record" in r.getMessage() for r in caplog.records), 10,
                 "the held-back rejects to be logged")
    lines = [r.getMessage() for r in caplog.records if "reject" in r.getMessage()]
    assert lines[0].startswith("rejected record: ") and "more like it" not in lines[0]
    assert lines[1:] == ["rejected 4 more record(s) for bad_magic in the last 0.5 s"], lines


def test_rejects_held_back_are_logged_when_the_daemon_stops(sock_path, caplog):
    """A daemon stopped (SIGTERM) within the interval of a burst of rejects never logged the
    burst's size: only its first line."""
    caplog.set_level("WARNING", logger="syncwatch.daemon")
    with DaemonThread(config(sock_path)) as d:
        Client(d.socket_path).send(*[b"garbage"] * 5)
        wait_records(d.url, 5)
    lines = [r.getMessage() for r in caplog.records if "reject" in r.getMessage()]
    assert lines[1:] == ["rejected 4 more record(s) for bad_magic in the last 10 s"], lines


def test_promtool_check_metrics_passes_on_a_real_scrape(daemon, client):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    _full_exposition(daemon, client)
    text = scrape_text(daemon.url)
    assert "syncwatch_barrier_skew_seconds_bucket" in text and "syncwatch_tokens_total" in text
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert r.returncode == 0 and not r.stdout and not r.stderr, (r.stdout, r.stderr)


PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _get(url: str, accept: str) -> tuple[str, str, str]:
    req = urllib.request.Request(url + "/metrics", headers={"Accept": accept,
                                                            "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req) as r:
        return (r.headers["Content-Type"], r.headers.get("Content-Encoding"),
                gzip.decompress(r.read()).decode())


def test_text_preferred_openmetrics_only_when_nothing_else_and_gzip(daemon, client):
    _full_exposition(daemon, client, ranks=2)
    ctype, encoding, body = _get(daemon.url, PROMETHEUS_ACCEPT)  # what Prometheus sends
    assert ctype.startswith("text/plain") and encoding == "gzip"
    assert 'syncwatch_steps_total{rank="0",train_job="job-a"} 4.0' in body
    ctype, encoding, body = _get(daemon.url, "application/openmetrics-text;version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and encoding == "gzip"
    assert body.endswith("# EOF\n")
    assert 'syncwatch_steps_total{rank="0",train_job="job-a"} 4' in body
    assert scrape_text(daemon.url).startswith("# HELP")


@pytest.mark.parametrize("zero", ["q=0", "q=0.0", "Q=0.00", "q=0.000"])
def test_a_weight_of_zero_refuses_a_format_or_gzip(daemon, client, zero):
    """RFC 9110: q=0, q=0.0, q=0.00 and q=0.000 all say "not acceptable". Only exact ``q=0``
    refused text/plain (``text/plain;q=0.0`` got text, not the OpenMetrics asked for), and any
    Accept-Encoding naming gzip got gzip, ``gzip;q=0`` included."""
    _full_exposition(daemon, client)
    req = urllib.request.Request(daemon.url + "/metrics", headers={
        "Accept": f"application/openmetrics-text;version=1.0.0, text/plain;{zero}",
        "Accept-Encoding": f"gzip;{zero}, identity"})
    with urllib.request.urlopen(req) as r:
        ctype, encoding, body = r.headers["Content-Type"], r.headers.get("Content-Encoding"), r.read()
    assert ctype.startswith("application/openmetrics-text") and encoding is None
    assert body.endswith(b"# EOF\n")
    req = urllib.request.Request(daemon.url + "/metrics", headers={
        "Accept": "text/plain;q=0.001", "Accept-Encoding": "GZIP;q=0.001"})
    with urllib.request.urlopen(req) as r:  # the least weight that accepts
        assert r.headers["Content-Type"].startswith("text/plain")
        assert r.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(r.read()).startswith(b"# HELP")


@pytest.mark.parametrize("version", ["x", "1.x", "1.0.0.x"])
def test_an_openmetrics_version_that_is_not_numbers_gets_text(daemon, client, version):
    """prometheus_client compares the version's parts as numbers: ``version=1.x`` raised in the
    scrape handler (a 500 and a traceback in the log at every scrape); ``1.0.0.x`` was echoed
    back in the Content-Type. Such a type is not one the daemon can serve: the text format."""
    _full_exposition(daemon, client)
    ctype, _, body = _get(daemon.url, f"application/openmetrics-text;version={version}")
    assert ctype.startswith("text/plain") and body.startswith("# HELP")
    ctype, _, body = _get(daemon.url, f"application/openmetrics-text;version={version}, "
                                      f"application/openmetrics-text;version=1.0.0")
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith("# EOF\n")


def test_a_media_type_is_read_whatever_its_case(daemon, client):
    """RFC 9110 8.3.1: type and subtype are case-insensitive. prometheus_client's choose_encoder
    compares them as written: a client accepting only ``Application/OpenMetrics-Text`` got the
    text format it had not asked for."""
    _full_exposition(daemon, client)
    ctype, _, body = _get(daemon.url, "Application/OpenMetrics-Text;version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.endswith("# EOF\n")


def test_text_star_gets_the_text_format_and_x_gzip_gets_gzip(daemon, client):
    """``text/*`` accepts text/plain (RFC 9110 12.5.1), so a client that prefers OpenMetrics and
    takes any text type gets the text format, as one naming text/plain does; ``x-gzip`` is gzip
    (RFC 9110 8.4.1.3). The tests named text/plain, */* and gzip only: a daemon that served
    OpenMetrics to ``text/*``, or no gzip to ``x-gzip``, passed them."""
    _full_exposition(daemon, client)
    req = urllib.request.Request(daemon.url + "/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0, text/*;q=0.5",
        "Accept-Encoding": "x-gzip"})
    with urllib.request.urlopen(req) as r:
        ctype, encoding = r.headers["Content-Type"], r.headers.get("Content-Encoding")
        body = r.read()
    assert ctype.startswith("text/plain") and encoding == "gzip"
    text = gzip.decompress(body).decode()
    assert text.startswith("# HELP") and not text.endswith("# EOF\n")

def test_series_per_rank_within_budget_at_64_ranks(daemon, client):
    _full_exposition(daemon, client, ranks=64)
    m = scrape(daemon.url)
    for rank in range(64):
        n = len(series_of(m, train_job="job-a", rank=rank))
        assert n <= 25, (rank, n)
        assert n == 21, (rank, n)  # every per-rank family of the contract, tokens included
    # Histograms are per node and job, never per rank.
    assert not [k for k in m if k[0].startswith("syncwatch_step_duration") and "rank" in dict(k[1])]


def test_silent_rank_removed_after_ttl(sock_path):
    with DaemonThread(config(sock_path, rank_ttl=0.4)) as d:
        c = Client(d.socket_path)
        alive, silent = RankSim(identity(0)), RankSim(identity(1))
        c.send(alive.step(1, 0.1), silent.step(1, 0.1))
        wait_records(d.url, 2)
        assert healthz(d.url)["ranks"] == 2
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # rank 0 heartbeats, rank 1 stays silent
            c.send(alive.enc.heartbeat(WALL0 + 2, 1, WALL0 + 1, "forward", 0.1, 2))
            time.sleep(0.1)
        m = scrape(d.url)
    assert not series_of(m, train_job="job-a", rank=1)
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 1
    assert value(m, "syncwatch_ranks_active") == 1


def test_job_removed_after_end_plus_grace(sock_path):
    """An ended rank's series stay ``--job-grace``, with its end's time and reason (a rank that
    completed is not lost: SyncwatchRankLost leaves it out)."""
    with DaemonThread(config(sock_path, job_grace=0.5, rank_ttl=30)) as d:
        c = Client(d.socket_path)
        sims = [RankSim(identity(r, world=2)) for r in range(2)]
        c.send(*(s.step(1, 0.1) for s in sims), sims[0].enc.end(WALL0 + 2, 1),
               sims[1].enc.end(WALL0 + 3, 1, "failed"))
        wait_records(d.url, 4)
        m = scrape(d.url)
        assert value(m, "syncwatch_steps_total", train_job="job-a", rank=1) == 1  # kept for the grace
        ends = sorted((dict(labels)["rank"], dict(labels)["reason"], v)
                      for (name, labels), v in m.items()
                      if name == "syncwatch_rank_end_timestamp_seconds")
        assert ends == [("0", "completed", WALL0 + 2), ("1", "failed", WALL0 + 3)]
        assert value(m, "syncwatch_job_world_size", train_job="job-a") == 2
        wait_for(lambda: healthz(d.url)["jobs"] == 0, 10, "job removal")
        m = scrape(d.url)
    assert not series_of(m, train_job="job-a")
    assert value(m, "syncwatch_ranks_active") == 0


def test_restarts_and_rerun_steps(daemon, client):
    a0 = RankSim(identity(0, attempt=0, pid=100))
    client.send(*(a0.step(s, 0.1, checkpoint=s == 40) for s in range(1, 51)))
    # Attempt 1 resumes from the checkpoint at step 40: steps 41..50 are computed again.
    a1 = RankSim(identity(0, attempt=1, pid=200))
    client.send(a1.enc.heartbeat(WALL0 + 60, 0, 0.0, "data", 2.0, 0))
    client.send(*(a1.step(s, 0.1) for s in range(41, 56)))
    wait_records(daemon.url, 66)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_job_restarts_total", train_job="job-a") == 1
    assert value(m, "syncwatch_job_rerun_steps_total", train_job="job-a") == 10
    assert value(m, "syncwatch_job_attempt", train_job="job-a") == 1
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 15  # the new process's own
    # Same attempt, new process, step goes backwards (in-place restart): 53..55 again.
    b = RankSim(identity(0, attempt=1, pid=300))
    client.send(*(b.step(s, 0.1, checkpoint=s == 60) for s in range(53, 61)))
    # Same attempt, new process, moving forward: not a restart.
    c = RankSim(identity(0, attempt=1, pid=400))
    client.send(c.step(61, 0.1))
    # A stale record of the old attempt is ignored.
    client.send(a0.step(51, 0.1))
    wait_records(daemon.url, 76)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_job_restarts_total", train_job="job-a") == 2
    assert value(m, "syncwatch_job_rerun_steps_total", train_job="job-a") == 13
    assert value(m, "syncwatch_job_attempt", train_job="job-a") == 1
    assert value(m, "syncwatch_last_step", train_job="job-a", rank=0) == 61


def test_a_container_restarted_in_place_is_a_restart_though_pid_and_attempt_repeat(daemon, client):
    """A container restarted in place (Kubernetes ``restartPolicy: OnFailure``): its new PID
    namespace gives the rank pid 7 again and torchrun's restart count starts again at 0; only the
    nonce differs. Read as the same process, the resumed steps 41..50 were ignored, 51.. rejected
    as bad_value (steps_total below the old count) and no restart counted."""
    old = RankSim(identity(0, pid=7, nonce=0x1111))
    client.send(*(old.step(s, 0.1, checkpoint=s == 40) for s in range(1, 51)))
    new = RankSim(identity(0, pid=7, nonce=0x2222))
    client.send(*(new.step(s, 0.1) for s in range(41, 56)))
    wait_records(daemon.url, 65)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_job_restarts_total", train_job="job-a") == 1
    assert value(m, "syncwatch_job_rerun_steps_total", train_job="job-a") == 10
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 15  # the new process's
    assert value(m, "syncwatch_last_step", train_job="job-a", rank=0) == 55
    assert value(m, "syncwatch_ingest_rejected_total", reason="bad_value") == 0


@pytest.mark.parametrize("pids", [((21, 0), (22, 0)), ((1, 5), (1, 6))],
                         ids=["two-pids", "one-pid-two-namespaces"])
def test_two_live_processes_as_one_rank_are_a_conflict_not_a_restart_each_record(daemon, client,
                                                                                  pids):
    """Two runs that share a job name on one node: pids 21 and 22 (or pid 1 twice, in two
    containers: two nonces) are both rank 0 of attempt 0, their records interleaved. Each replaced
    the other's state in turn: steps_total swung between
    their counts (a counter reset at every scrape), and each swing to the lower step counted a
    restart (10 restarts, 1010 re-run steps over 10 steps each). The second process takes over
    once, as a restart in place would; the first one speaking again is then a conflict, rejected."""
    (pa, na), (pb, nb) = pids
    a, b = RankSim(identity(0, pid=pa, nonce=na)), RankSim(identity(0, pid=pb, nonce=nb))
    for s in range(10):
        client.send(a.step(101 + s, 0.1), b.step(1 + s, 0.1))
    wait_records(daemon.url, 20)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_ingest_rejected_total", reason="identity_conflict") == 9
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 10  # the later run's
    assert value(m, "syncwatch_job_restarts_total", train_job="job-a") == 1  # its take-over
    assert value(m, "syncwatch_rank_info", train_job="job-a", rank=0, local_rank=0, node="node-1",
                 gpu="", uuid="", pid=pb) == 1


def test_a_restarted_process_before_its_first_step_has_no_step_timestamp(daemon, client):
    """What SyncwatchJobStuckAtStart reads: a restart that hangs before its first step leaves
    its rank reporting (rank_info, its phase) without a step timestamp, not the old process's."""
    a0 = RankSim(identity(0, attempt=0, pid=100))
    client.send(*(a0.step(s, 0.1) for s in range(1, 6)))
    a1 = RankSim(identity(0, attempt=1, pid=200))
    client.send(a1.enc.heartbeat(WALL0 + 60, 0, 0.0, "sync", 30.0, 1))
    wait_records(daemon.url, 6)
    m = scrape(daemon.url)
    lab = dict(train_job="job-a", rank=0)
    assert value(m, "syncwatch_rank_info", local_rank=0, node="node-1", gpu="", uuid="", pid=200,
                 **lab) == 1
    assert value(m, "syncwatch_rank_phase_elapsed_seconds", phase="sync", **lab) == 30.0
    assert value(m, "syncwatch_last_step_timestamp_seconds", **lab) is None


def test_a_new_process_with_a_lower_attempt_takes_over_once_the_old_one_is_gone():
    """Two resumes in one process (attempts 1, 2), then a launcher restart numbered 1: the new
    process's lower attempt is stale only while the old one could still be sending, not until
    the old one's state expires (``--rank-ttl``, a minute of the new process's records lost)."""
    now = [1000.0]
    state = State(DaemonConfig(socket=None), clock=lambda: now[0])
    decoder = Decoder()

    def send(*data):
        for d in data:
            state.apply(decoder.decode(d))
            now[0] += 0.1

    def rank(r, ranks=None):
        ranks = ranks or state.snapshot().jobs[0].ranks
        return next(v for v in ranks if v.ident.rank == r)

    old = [RankSim(identity(r, world=2, attempt=2, pid=100 + r)) for r in range(2)]
    send(*(o.step(s, 0.1) for s in range(1, 31) for o in old))
    new = [RankSim(identity(r, world=2, attempt=1, pid=200 + r)) for r in range(2)]
    send(old[1].enc.end(WALL0 + 31, 30))           # rank 1's old process ended: gone for sure
    send(new[0].step(21, 0.1), new[1].step(21, 0.1))
    assert rank(0).ident.pid == 100 and rank(1).ident.pid == 201  # rank 0's old one may be live
    now[0] += SUPERSEDE_SECONDS                     # rank 0's old process fell silent
    send(new[0].step(22, 0.1))
    job = state.snapshot().jobs[0]
    assert rank(0, job.ranks).ident.pid == 200 and rank(0, job.ranks).last_step == 22
    assert rank(1, job.ranks).ident.pid == 201 and rank(1, job.ranks).last_step == 21
    assert job.attempt == 1 and job.restarts == 1 and job.rerun_steps == 9  # 22..30 again


def test_limit_rejects_name_the_job_or_rank_left_out_and_the_flag():
    """Logged as "job_limit: already 1 jobs": not which job was missing from the dashboards, nor
    what to raise."""
    state, decoder = State(DaemonConfig(socket=None, max_jobs=1, max_ranks=2)), Decoder()
    state.apply(decoder.decode(RankSim(identity(0)).step(1, 0.1)))
    with pytest.raises(ProtocolError) as e:
        state.apply(decoder.decode(RankSim(identity(0, job="job-b")).step(1, 0.1)))
    assert str(e.value) == "job_limit: train job 'job-b' not tracked: already 1 jobs (--max-jobs)"
    state.apply(decoder.decode(RankSim(identity(1)).step(1, 0.1)))
    with pytest.raises(ProtocolError) as e:
        state.apply(decoder.decode(RankSim(identity(2)).step(1, 0.1)))
    assert str(e.value) == "rank_limit: train job 'job-a' rank 2 not tracked: already 2 ranks (--max-ranks)"


@pytest.mark.parametrize("attempt", [0, 1])
def test_rerun_steps_count_from_rank0s_highest_step_its_heartbeats_told(attempt):
    """A daemon started under a hung rank 0 hears only its heartbeats (last step 50); the job
    restarts from the checkpoint at 40, as a new attempt or in place (a new pid of the same
    attempt). The previous highest step was taken from step records only: 0 re-run steps for 10,
    and the restart in place not counted at all (its first step did not go "backwards" from
    nothing). A lost last step record, its step told by the end record, undercounted the same way."""
    state, decoder = State(DaemonConfig(socket=None)), Decoder()
    hung = RankSim(identity(0, world=1, attempt=0, pid=100))
    state.apply(decoder.decode(hung.enc.heartbeat(WALL0 + 60, 50, WALL0 + 50, "sync", 10.0, 100)))
    new = RankSim(identity(0, world=1, attempt=attempt, pid=200))
    for s in range(41, 46):
        state.apply(decoder.decode(new.step(s, 0.1)))
    job = state.snapshot().jobs[0]
    assert (job.restarts, job.rerun_steps) == (1, 10)
    # the step record of 46 lost, the end record tells it: the next restart re-runs 43..46
    state.apply(decoder.decode(new.enc.end(WALL0 + 70, 46)))
    later = RankSim(identity(0, world=1, attempt=attempt + 1, pid=300))
    state.apply(decoder.decode(later.step(43, 0.1)))
    job = state.snapshot().jobs[0]
    assert (job.restarts, job.rerun_steps) == (2, 14)
    # a daemon (re)started just before rank 0's end record: its last step is all it knows
    state, decoder = State(DaemonConfig(socket=None)), Decoder()
    state.apply(decoder.decode(later.enc.end(WALL0 + 80, 47)))
    state.apply(decoder.decode(RankSim(identity(0, world=1, attempt=attempt + 2, pid=400))
                               .step(44, 0.1)))
    job = state.snapshot().jobs[0]
    assert (job.restarts, job.rerun_steps) == (1, 4)


def test_job_series_come_only_from_the_daemon_that_hears_rank0(sock_path):
    """A restart moves rank 0 to another node while rank 1 stays here: once rank 0's old process
    expires, this daemon no longer hears rank 0 and stops reporting the job's series. It kept
    reporting the old attempt as long as any rank of the job ran here, and the rules, which count
    the job's attempts across daemons, read that stale attempt as a restart in every hour."""
    with DaemonThread(config(sock_path, rank_ttl=0.5)) as d:
        c = Client(d.socket_path)
        r0, r1 = RankSim(identity(0, world=2, pid=100)), RankSim(identity(1, world=2, pid=101))
        c.send(r0.step(1, 0.1), r1.step(1, 0.1))
        wait_records(d.url, 2)
        assert value(scrape(d.url), "syncwatch_job_attempt", train_job="job-a") == 0
        # attempt 1: rank 1 here again, rank 0 on another node
        r1 = RankSim(identity(1, world=2, attempt=1, pid=201))

        def rank0_gone():
            c.send(r1.step(r1.totals.steps + 1, 0.1))
            time.sleep(0.05)
            return series_of(scrape(d.url), train_job="job-a", rank=0) == []
        wait_for(rank0_gone, 10, "rank 0's old process to expire")
        m = scrape(d.url)
        assert value(m, "syncwatch_steps_total", train_job="job-a", rank=1) >= 1
        assert [k for k in m if k[0].startswith(("syncwatch_job_", "syncwatch_checkpoint"))] == []
        # rank 0 comes back here (attempt 2): the job's series again, its restarts counted on
        r0 = RankSim(identity(0, world=2, attempt=2, pid=300))
        c.send(r0.step(5, 0.1))
        wait_for(lambda: value(scrape(d.url), "syncwatch_job_attempt", train_job="job-a") == 2,
                 10, "rank 0 back")
        assert value(scrape(d.url), "syncwatch_job_restarts_total", train_job="job-a") == 1


def test_checkpoint_totals_come_from_rank0(daemon, client):
    r0 = RankSim(identity(0))
    ck = tuple(0.5 if p == "checkpoint" else 0.01 for p in PHASES)
    client.send(r0.step(1, 0.6, phases=ck, checkpoint=True), r0.step(2, 0.1),
                r0.step(3, 0.6, phases=ck, checkpoint=True))
    client.send(RankSim(identity(1)).step(1, 0.6, phases=ck, checkpoint=True))
    wait_records(daemon.url, 4)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_checkpoints_total", train_job="job-a") == 2
    assert value(m, "syncwatch_checkpoint_seconds_total", train_job="job-a") == pytest.approx(
        1.0 + 0.1 / len(PHASES))


def test_checkpoint_totals_wait_for_rank0s_step_record_after_a_daemon_restart(daemon, client):
    """A daemon (re)started under a running rank 0 between two of its steps hears a heartbeat
    first. It exported checkpoints_total and checkpoint_seconds_total 0 until the next step
    record brought rank 0's cumulative values: after the old daemon's 3, Prometheus read 3 -> 0
    -> 4 as a reset and counted the process's every checkpoint again (increase() 4 for 1; the
    per-rank counters, exported only from a step record, were right). A new process of rank 0
    still starts them at 0: its own counters do."""
    ck = tuple(0.5 if p == "checkpoint" else 0.01 for p in PHASES)
    r0 = RankSim(identity(0, world=1, pid=100))
    for s in range(1, 4):
        r0.step(s, 0.6, phases=ck, checkpoint=True)  # sent to the daemon before this one
    client.send(r0.enc.heartbeat(WALL0 + 4, 3, WALL0 + 3, "data", 1.0, 6))
    wait_records(daemon.url, 1)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_job_attempt", train_job="job-a") == 0
    assert value(m, "syncwatch_checkpoints_total", train_job="job-a") is None
    assert value(m, "syncwatch_checkpoint_seconds_total", train_job="job-a") is None
    client.send(r0.step(4, 0.6, phases=ck, checkpoint=True))
    wait_records(daemon.url, 2)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_checkpoints_total", train_job="job-a") == 4
    assert value(m, "syncwatch_checkpoint_seconds_total", train_job="job-a") == pytest.approx(2.0)
    # attempt 1: a new process, whose counters start at 0, before its first step
    client.send(RankSim(identity(0, world=1, attempt=1, pid=200)).enc.heartbeat(
        WALL0 + 10, 0, 0.0, "data", 1.0, 0))
    wait_records(daemon.url, 3)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_checkpoints_total", train_job="job-a") == 0
    assert value(m, "syncwatch_checkpoint_seconds_total", train_job="job-a") == 0


def test_heartbeat_only_rank_shows_phase_and_stale_step_time(daemon, client):
    hung = Encoder(identity(3))
    now = time.time()
    client.send(hung.heartbeat(now - 5, 7, now - 100, "sync", 95.0, 40))
    client.send(hung.heartbeat(now, 7, now - 100, "sync", 100.0, 40))
    wait_records(daemon.url, 2)
    m = scrape(daemon.url)
    lab = dict(train_job="job-a", rank=3)
    assert value(m, "syncwatch_rank_phase_elapsed_seconds", phase="sync", **lab) == 100.0
    assert len([k for k in m if k[0] == "syncwatch_rank_phase_elapsed_seconds"]) == 1
    assert value(m, "syncwatch_last_step_timestamp_seconds", **lab) == pytest.approx(now - 100)
    assert value(m, "syncwatch_last_step", **lab) == 7
    assert value(m, "syncwatch_collective_sequence", **lab) == 40
    assert value(m, "syncwatch_steps_total", **lab) is None  # no step record yet: no counters
    assert value(m, "syncwatch_rank_info", local_rank=3, node="node-1", gpu="", uuid="", pid=1003, **lab) == 1


def test_a_record_stamped_in_the_future_pins_nothing(daemon, client):
    """A rank's clock an hour ahead, then stepped back (NTP at boot): its heartbeats after that
    show the phase it is in now, and its last step's timestamp is the latest step's own. By the
    records' wall times, the future ones had hidden every later heartbeat and pinned the step
    timestamp an hour ahead, where SyncwatchJobStalled could not see the job stall."""
    r = RankSim(identity(3))
    hb = Encoder(identity(3))
    now = time.time()
    client.send(r.step(1, 0.1, wall=now + 3600), hb.heartbeat(now + 3600, 1, now + 3600,
                                                               "checkpoint", 5.0, 1))
    client.send(r.step(2, 0.1, wall=now - 200), hb.heartbeat(now, 2, now - 200, "sync", 200.0, 2))
    wait_records(daemon.url, 4)
    m = scrape(daemon.url)
    lab = dict(train_job="job-a", rank=3)
    assert value(m, "syncwatch_rank_phase_elapsed_seconds", phase="sync", **lab) == 200.0
    assert value(m, "syncwatch_rank_phase_elapsed_seconds", phase="checkpoint", **lab) is None
    assert value(m, "syncwatch_last_step_timestamp_seconds", **lab) == pytest.approx(now - 200)
    assert value(m, "syncwatch_last_step", **lab) == 2


def test_a_step_count_that_goes_down_within_a_process_is_rejected(daemon, client):
    """Step 2 of the same process saying it has done fewer steps than step 1 did: the exported
    counter would go down, which Prometheus reads as a reset and counts again. Rejected as
    ``bad_value``; the counter keeps what it had."""
    r = RankSim(identity(1))
    client.send(r.step(1, 0.1), r.step(2, 0.1))
    r.totals = Cumulative()  # the next record counts 1 step
    client.send(r.step(3, 0.1))
    wait_records(daemon.url, 3)
    m = scrape(daemon.url)
    assert value(m, "syncwatch_ingest_rejected_total", reason="bad_value") == 1
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=1) == 2
    r.totals = Cumulative(steps=9)
    client.send(r.step(4, 0.1))  # the same process going on, 10 steps: accepted
    wait_records(daemon.url, 4)
    assert value(scrape(daemon.url), "syncwatch_steps_total", train_job="job-a", rank=1) == 10


def test_client_dropped_records_and_internal_errors_are_monotonic(sock_path):
    """Both sum what each rank process's cumulative count grew by: an older (smaller) count
    adds nothing, a new process (pid) starts from 0, and ranks leaving take nothing away."""
    with DaemonThread(config(sock_path, rank_ttl=0.3)) as d:
        scrape(d.url)  # the first one, which shows the counts as 0
        c = Client(d.socket_path)
        r = RankSim(identity(2, pid=10))
        c.send(r.step(1, 0.1, dropped=5, errors=1), r.step(2, 0.1, dropped=8, errors=3))
        c.send(Encoder(identity(2, pid=10)).heartbeat(WALL0, 1, 0.0, "data", 0.1, 0,
                                                      dropped_records=6, internal_errors=2))
        c.send(Encoder(identity(2, pid=11)).heartbeat(WALL0, 0, 0.0, "data", 0.1, 0,
                                                      dropped_records=2, internal_errors=4))
        wait_records(d.url, 4)
        m = scrape(d.url)
        assert value(m, "syncwatch_client_dropped_records_total") == 10
        assert value(m, "syncwatch_client_internal_errors_total") == 7
        wait_for(lambda: healthz(d.url)["ranks"] == 0, 10, "rank expiry")
        m = scrape(d.url)
    assert value(m, "syncwatch_client_dropped_records_total") == 10
    assert value(m, "syncwatch_client_internal_errors_total") == 7


def test_a_process_met_anew_counts_only_what_its_delivered_records_had_not_reported(sock_path):
    """A daemon meeting a rank's process (after the daemon's restart, or once the rank's state
    expired) counted all of the process's drops and errors, those it had reported before
    included: each record now says what the last one delivered before it carried."""
    with DaemonThread(config(sock_path, rank_ttl=0.3)) as d:
        scrape(d.url)  # the first one, which shows the counts as 0
        c = Client(d.socket_path)
        enc = Encoder(identity(2, pid=10))
        c.send(RankSim(identity(2, pid=10)).step(1, 0.1, dropped=5, errors=1))
        wait_records(d.url, 1)
        wait_for(lambda: healthz(d.url)["ranks"] == 0, 10, "rank expiry")
        # silent past the TTL, the process reports again: 4 more drops, 2 more errors
        c.send(enc.heartbeat(WALL0, 1, WALL0, "data", 0.1, 0, dropped_records=9,
                             internal_errors=3, reported_dropped=5, reported_errors=1))
        wait_records(d.url, 2)
        m = scrape(d.url)
    assert value(m, "syncwatch_client_dropped_records_total") == 9
    assert value(m, "syncwatch_client_internal_errors_total") == 3


def test_a_restarted_daemon_shows_its_drop_counts_from_0_once(sock_path):
    """A daemon restarted on a node whose ranks dropped records while it was down counts them
    from their first record, at once, before Prometheus's first scrape of it. It exported that
    backlog from its first scrape: after its predecessor's 10, a first 100 was no counter reset
    to Prometheus, which read 10 -> 100 as 90 more (and a second restart's 100 after the
    first's 100 as none). Its first scrape now shows 0, the reset, and the next ones its counts."""
    with DaemonThread(config(sock_path)) as d:
        c = Client(d.socket_path)
        c.send(Encoder(identity(0, pid=10)).heartbeat(WALL0, 3, WALL0, "data", 0.1, 0,
                                                      dropped_records=110, internal_errors=4,
                                                      reported_dropped=10, reported_errors=1))
        wait_records(d.url, 1)
        first, second = scrape(d.url), scrape(d.url)
    assert value(first, "syncwatch_client_dropped_records_total") == 0
    assert value(first, "syncwatch_client_internal_errors_total") == 0
    assert value(second, "syncwatch_client_dropped_records_total") == 100
    assert value(second, "syncwatch_client_internal_errors_total") == 3


class _Failing:
    def __init__(self):
        self.started = self.stopped = False

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True

    def collect(self):
        raise RuntimeError("sensor on fire")


class _Working:
    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        yield GaugeMetricFamily("syncwatch_test_extra", "An extra collector.", value=42)


def test_extra_collectors_are_guarded(sock_path):
    failing = _Failing()
    with DaemonThread(config(sock_path), extra_collectors=[failing, _Working()]) as d:
        assert failing.started
        m = scrape(d.url)
    assert failing.stopped
    assert value(m, "syncwatch_test_extra") == 42
    assert value(m, "syncwatch_build_info", version=__import__("syncwatch").__version__) == 1


def test_udp_ingest(sock_path):
    with DaemonThread(config(None, udp="127.0.0.1:0")) as d:
        s = Sender(udp=d.udp_address)
        sim = RankSim(identity(0))
        for step in range(1, 11):
            assert s.send(sim.step(step, 0.1))
        wait_records(d.url, 10)
        m = scrape(d.url)
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 10


def test_healthz(daemon, client):
    client.send(_valid_step(), b"junk")
    h = wait_records(daemon.url, 2)
    assert h == {"status": "ok", "ranks": 1, "jobs": 1, "records": 1, "rejected": 1}


def test_socket_file_modes_and_stale_socket_replaced(sock_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(sock_path)
    stale.close()  # the file stays, nobody listens: what a crashed daemon leaves
    with DaemonThread(config(sock_path)) as d:
        assert os.stat(sock_path).st_mode & 0o777 == 0o660
        Client(sock_path).send(_valid_step())
        wait_records(d.url, 1)
        with pytest.raises(OSError, match="in use by another running daemon"):
            DaemonThread(config(sock_path)).start()
    assert not os.path.exists(sock_path)  # removed on clean stop


def test_live_socket_this_user_may_not_probe_is_left_alone(sock_path):
    """A daemon of another user holds the socket and this one may not connect (EACCES) but may
    write the directory: the second daemon must refuse, not unlink and take over the path."""
    live = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    live.bind(sock_path)
    os.chmod(sock_path, 0)  # nobody without DAC override may connect, the owner included
    inode = os.stat(sock_path).st_ino
    prefix = []
    if os.geteuid() == 0:  # root would connect anyway: run the second daemon without DAC override
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv (util-linux) is absent")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    try:
        second = subprocess.Popen(prefix + _daemon_cmd("--listen", "127.0.0.1:0", "--socket", sock_path),
                                  env=subprocess_env(), stderr=subprocess.PIPE, text=True)
        try:
            _, err = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.communicate()
            pytest.fail(f"the second daemon kept running; socket inode {inode} -> "
                        f"{os.stat(sock_path).st_ino if os.path.exists(sock_path) else 'gone'}")
        assert second.returncode == 2, err
        assert "cannot be probed (Permission denied)" in err, err
        assert os.stat(sock_path).st_ino == inode  # the live daemon's socket file is still there
        os.chmod(sock_path, 0o660)
        Client(sock_path).send(b"still reachable")
        live.settimeout(5)
        assert live.recv(64) == b"still reachable"
    finally:
        live.close()


def test_socket_directory_created_0750(tmp_path):
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "run", "ingest.sock")
    with DaemonThread(config(path)):
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o750


def test_a_socket_path_too_long_for_unix_sockets_says_so():
    # bind() raises OSError("AF_UNIX path too long") without a strerror: the daemon said
    # "cannot bind ingest socket ...: None", after creating the socket's directory
    import tempfile
    base = tempfile.mkdtemp(prefix="sw-")
    path = os.path.join(base, "d" * (107 - len(base) - len("//ingest.sock")), "ingest.sock")
    assert len(path) == 107
    with DaemonThread(config(path)):
        assert stat.S_ISSOCK(os.stat(path).st_mode)  # 107 bytes is the most that binds
    longer = os.path.join(base, "e" * (108 - len(base) - len("//ingest.sock")), "ingest.sock")
    r = subprocess.run(_daemon_cmd("--listen", "127.0.0.1:0", "--socket", longer),
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == (f"syncwatch daemon: socket path {longer} is 108 bytes; a Unix socket path "
                        f"has at most 107: choose a shorter one\n")
    assert not os.path.exists(os.path.dirname(longer))


def test_cli_sigterm_clean_and_errors_exit_2(sock_path):
    proc, url = _start_cli_daemon(sock_path)
    Client(sock_path).send(_valid_step())
    wait_records(url, 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not os.path.exists(sock_path)

    r = subprocess.run(_daemon_cmd("--listen", "127.0.0.1:0", "--socket", "/proc/no/such/x.sock"),
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "socket directory" in r.stderr, r.stderr

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        r = subprocess.run(_daemon_cmd("--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--socket", ""),
                           env=subprocess_env(), capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "address already in use" in r.stderr.lower(), r.stderr


@pytest.mark.parametrize("flags, says", [
    (["--listen", "9477"], "listen must look like 127.0.0.1:9477, got '9477'"),
    (["--listen", "127.0.0.1:0", "--udp", "9478"], "udp must look like 127.0.0.1:9478, got '9478'"),
])
def test_a_bad_address_is_shown_an_example_of_its_own_flag(flags, says):
    """The parser shared by --listen and --udp showed the UDP ingest's 127.0.0.1:9478 for both:
    ``--listen 9477`` was told to look like the UDP port. Each now shows its own."""
    r = subprocess.run(_daemon_cmd("--socket", "", *flags), env=subprocess_env(),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (2, f"syncwatch daemon: {says}\n")


@pytest.mark.parametrize("twin, value, says", [
    ("SYNCWATCH_UDP", "x", "--udp (from SYNCWATCH_UDP): udp must look like 127.0.0.1:9478, got 'x'"),
    ("SYNCWATCH_LISTEN", "10.0.0.5", "--listen (from SYNCWATCH_LISTEN): listen must look like "
                                     "127.0.0.1:9477, got '10.0.0.5'"),
    ("SYNCWATCH_WINDOW", "1", "--window (from SYNCWATCH_WINDOW): window must be at least 3 steps, got 1"),
    ("SYNCWATCH_CV_SECONDS", "nan", "--cv-seconds (from SYNCWATCH_CV_SECONDS): cv_seconds must be a "
                                    "positive number of seconds (inf: the whole window), got nan"),
    ("SYNCWATCH_LOG_LEVEL", "verbose", "--log-level (from SYNCWATCH_LOG_LEVEL) must be debug, info, "
                                       "warning or error, got 'verbose'"),
    ("SYNCWATCH_COLLECTOR_INTERVAL", "0", "--collector.interval (from SYNCWATCH_COLLECTOR_INTERVAL) "
                                         "must be positive and finite, got 0"),
    ("SYNCWATCH_COLLECTOR_TIMEOUT", "nan", "--collector.timeout (from SYNCWATCH_COLLECTOR_TIMEOUT) "
                                           "must be positive and finite, got nan"),
    ("SYNCWATCH_SOCKET", "/tmp/" + "x" * 120, "--socket (from SYNCWATCH_SOCKET): socket path /tmp/"
                                              + "x" * 120 + " is 125 bytes; a Unix socket path has "
                                              "at most 107: choose a shorter one"),
])
def test_a_bad_value_from_a_twin_names_the_twin(twin, value, says):
    """Set in /etc/default/syncwatch (the systemd unit's settings) or a pod's environment, a bad
    value was told as "udp must look like ...", naming no variable and no flag, and a bad log
    level as logging's "Unknown level: 'VERBOSE'". The README says an error about a value that
    came from a twin names it."""
    flags = {"SYNCWATCH_LISTEN": ("--socket", ""), "SYNCWATCH_SOCKET": ("--listen", "127.0.0.1:0")
             }.get(twin, ("--listen", "127.0.0.1:0", "--socket", ""))
    r = subprocess.run(_daemon_cmd(*flags), env=subprocess_env(**{twin: value}),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (2, f"syncwatch daemon: {says}\n")


def test_env_twins_configure_the_daemon(sock_path):
    import argparse

    from syncwatch.daemon.main import config_from_args, register
    os.environ["SYNCWATCH_RANK_TTL"] = "7.5"
    try:
        p = argparse.ArgumentParser()
        register(p.add_subparsers())
        cfg = config_from_args(p.parse_args(["daemon", "--socket", "", "--max-jobs", "3"]))
    finally:
        del os.environ["SYNCWATCH_RANK_TTL"]
    assert (cfg.rank_ttl, cfg.max_jobs, cfg.socket, cfg.listen) == (7.5, 3, None, "127.0.0.1:9477")


@pytest.mark.parametrize("field", ["rank_ttl", "job_grace"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_ttl_or_grace_is_a_config_error(field, bad):
    # NaN passed "> 0" unnoticed: every "silent past the TTL" comparison is then False, no rank or
    # job ever expired, and once --max-ranks ranks had come and gone every new rank was rejected
    with pytest.raises(ValueError, match=field):
        DaemonConfig(socket=None, **{field: bad})


def test_non_finite_and_struct_level_garbage_never_crash_the_reader(daemon, client):
    rng = random.Random(11)
    good = _valid_step()
    n = 0
    for _ in range(300):  # random mutations of a valid record
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        client.send(bytes(b))
        n += 1
    client.send(struct.pack("<2sBBH", b"SW", 1, 1, 0xFFFF))
    client.send(_valid_step())
    h = wait_records(daemon.url, n + 2)
    assert h["records"] >= 1 and h["records"] + h["rejected"] == n + 2
    assert math.isfinite(value(scrape(daemon.url), "syncwatch_ingest_records_total"))
