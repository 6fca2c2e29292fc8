"""Multi-process tests: real torch gloo ranks (one intra-op thread each) -> real daemon /metrics.

Each rank is a process started like torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT from a free port); ``tests/instrument/ddp_worker.py`` is the training script.
"""

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import subprocess_env

torch = pytest.importorskip("torch")
daemon_app = pytest.importorskip("syncwatch.daemon.app")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from syncwatch.daemon.config import DaemonConfig  # noqa: E402

WORKER = str(Path(__file__).parent / "instrument" / "ddp_worker.py")
RESUME_WORKER = str(Path(__file__).parent / "instrument" / "resume_worker.py")
CUDA_WORKER = str(Path(__file__).parent / "instrument" / "cuda_worker.py")
PREFETCH_WORKER = str(Path(__file__).parent / "instrument" / "prefetch_worker.py")
DELAY = 0.04


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args: list[str], tmp_path: Path, tag: str, *, script: str = WORKER,
           wrapper: list[str] = (), **env) -> list[subprocess.Popen]:
    """Start ``script args`` (behind ``wrapper``, e.g. ``syncwatch-run``'s command) once per rank,
    as torchrun starts its workers; each rank's output goes to ``tmp_path/tag-rankN.log``."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        log = open(tmp_path / f"{tag}-rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [*wrapper, sys.executable, script, *args], stdout=log, stderr=subprocess.STDOUT,
            env=subprocess_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=port, **env)))
    return procs


def finish(procs, tmp_path: Path, tag: str, timeout: float = 90) -> None:
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text()[-2000:] for f in sorted(tmp_path.glob(f"{tag}-rank*.log")))
    assert [p.returncode for p in procs] == [0] * len(procs), logs


class Metrics:
    def __init__(self, url: str):
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def get(self, name: str, **labels) -> list:
        return [s for s in self.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def by_rank(self, name: str, **labels) -> dict[int, float]:
        return {int(s.labels["rank"]): s.value for s in self.get(name, **labels)}

    def value(self, name: str, **labels) -> float | None:
        found = self.get(name, **labels)
        return found[0].value if found else None


def scrape_until(daemon, cond, timeout: float = 30.0) -> Metrics:
    end = time.monotonic() + timeout
    while True:
        m = Metrics(daemon.url)
        if cond(m) or time.monotonic() > end:
            return m
        time.sleep(0.1)


def every_window_in(m: Metrics, job: str, steps: int) -> bool:
    """Whether the last arrivals cover all ``steps`` (the last window's come with shutdown)."""
    return sum(m.by_rank("syncwatch_last_arrivals_total", train_job=job).values()) >= steps


@pytest.fixture
def daemon(sock_path):
    d = daemon_app.DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock_path))
    running = d.__enter__()
    yield running
    d.__exit__(None, None, None)


def test_straggler_is_named_by_exact_slack_and_last_arrivals(daemon, sock_path, tmp_path):
    job = "straggler"
    procs = launch(4, ["--instrument", "explicit", "--steps", "100", "--slow-rank", "2",
                       "--delay", str(DELAY)], tmp_path, job,
                   SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="20")
    finish(procs, tmp_path, job)
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                     == {r: 100.0 for r in range(4)} and every_window_in(m, job, 100))
    assert m.by_rank("syncwatch_steps_total", train_job=job) == {r: 100.0 for r in range(4)}
    last = m.by_rank("syncwatch_last_arrivals_total", train_job=job)
    exchanged = sum(last.values())  # steps covered by finished exchanges (ties are rare)
    assert exchanged >= 100  # all 5 windows: the last one's results came with shutdown
    assert last[2] >= 0.9 * exchanged, last
    slack = m.by_rank("syncwatch_slack_seconds_total", train_job=job)
    for r in (0, 1, 3):
        assert slack[r] / exchanged == pytest.approx(DELAY, rel=0.10), (r, slack, exchanged)
    assert slack[2] / exchanged < 0.1 * DELAY
    count = m.value("syncwatch_barrier_skew_seconds_count", train_job=job)
    total = m.value("syncwatch_barrier_skew_seconds_sum", train_job=job)
    assert count == 100 and 0.9 * DELAY <= total / count <= 1.3 * DELAY
    below = m.value("syncwatch_barrier_skew_seconds_bucket", train_job=job, le="0.025")
    assert below <= 0.1 * count  # the skew sits at the injected delay, not below it


def test_the_gradient_wait_is_measured_where_ddp_ignores_the_first_layer(daemon, sock_path,
                                                                         tmp_path):
    """DDP told to ignore the first layer's parameters (another parallelism's: MoE experts). The
    hook-free path hooked that layer: its gradient, the last computed, comes after DDP queued its
    finalize, so both callbacks ran after the wait. Rank 0's 30 ms wait for the slow rank 1 read
    0.01 ms, and counted as backward."""
    job, steps, delay = "ignored", 20, 0.03
    procs = launch(2, ["--instrument", "explicit", "--steps", str(steps), "--slow-rank", "1",
                       "--delay", str(delay), "--ignore-first"], tmp_path, job,
                   SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job)
    finish(procs, tmp_path, job)
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                     == {0: steps, 1: steps})
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    assert sync[0] >= 0.8 * steps * delay > sync[1], sync


def test_slow_steps_shorten_the_windows_after_the_first(daemon, sock_path, tmp_path):
    """Steps of over 0.1 s with K = 20 and a target of 0.5 s between exchanges: after the first
    window (20 steps) the windows are 0.5 s of steps (4 or fewer, all dividing the 12 left), so
    all 32 steps are exchanged; with K fixed, the last 12 never were (a partial window)."""
    job, steps = "slow-steps", 32
    procs = launch(2, ["--instrument", "explicit", "--steps", str(steps), "--step-pause", "0.1"],
                   tmp_path, job, SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job,
                   SYNCWATCH_SKEW_EVERY="20", SYNCWATCH_SKEW_SECONDS="0.5")
    finish(procs, tmp_path, job)
    m = scrape_until(daemon, lambda m: m.value("syncwatch_barrier_skew_seconds_count",
                                               train_job=job) == steps)
    assert m.value("syncwatch_barrier_skew_seconds_count", train_job=job) == steps
    assert sum(m.by_rank("syncwatch_last_arrivals_total", train_job=job).values()) >= steps


@pytest.mark.parametrize("wrap", ["fully_shard", "fsdp"])
def test_fsdp_straggler_is_named_through_its_wrapped_collectives(daemon, sock_path, tmp_path, wrap):
    """FSDP (``fully_shard`` and ``FullyShardedDataParallel``) with the explicit API: nothing is
    attached to the model, its all-gathers and reduce-scatters are wrapped collectives, and the
    slow rank's delay is the others' wait before the first all-gather of the forward."""
    job, steps = f"straggler-{wrap}", 60
    procs = launch(4, ["--instrument", "explicit", "--wrap", wrap, "--steps", str(steps),
                       "--slow-rank", "2", "--delay", str(DELAY)], tmp_path, job,
                   SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="10")
    finish(procs, tmp_path, job)
    every = {r: float(steps) for r in range(4)}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every
                     and every_window_in(m, job, steps))
    assert m.by_rank("syncwatch_steps_total", train_job=job) == every
    for r in range(4):  # registering an FSDP model is no error: none of syncwatch's warnings
        text = (tmp_path / f"{job}-rank{r}.log").read_text()
        assert "syncwatch:" not in text, text[-2000:]
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    for r in (0, 1, 3):  # every rank waits in FSDP's collectives; the others for rank 2 too
        assert sync[r] - sync[2] == pytest.approx(steps * DELAY, rel=0.15), sync
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")
    for r in (0, 1, 3):  # the wait is sync, not forward
        assert forward[2] >= steps * DELAY > 2 * forward[r], forward
    last = m.by_rank("syncwatch_last_arrivals_total", train_job=job)
    exchanged = sum(last.values())
    assert exchanged >= steps
    assert last[2] >= 0.9 * exchanged, last
    slack = m.by_rank("syncwatch_slack_seconds_total", train_job=job)
    for r in (0, 1, 3):
        assert slack[r] / exchanged == pytest.approx(DELAY, rel=0.10), (r, slack, exchanged)
    count = m.value("syncwatch_barrier_skew_seconds_count", train_job=job)
    total = m.value("syncwatch_barrier_skew_seconds_sum", train_job=job)
    assert count >= 40 and 0.9 * DELAY <= total / count <= 1.3 * DELAY


def test_fsdp_all_gather_prefetched_async_is_waited_as_sync(daemon, sock_path, tmp_path):
    """``fully_shard`` with explicit prefetching: the first layer's all-gather issued with
    ``unshard(async_op=True)`` and waited for in its pre-forward. The wait for the slow rank is
    in that all-gather's work: it was not timed, so rank 0's 30 ms wait read as its forward,
    its slack ~0, and the last arrivals fell on either rank."""
    job, steps, delay = "prefetch", 20, 0.03
    procs = launch(2, ["--steps", str(steps), "--slow-rank", "1", "--delay", str(delay)],
                   tmp_path, job, script=PREFETCH_WORKER, SYNCWATCH_SOCKET=sock_path,
                   SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="10")
    finish(procs, tmp_path, job)
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                     == {0: steps, 1: steps} and every_window_in(m, job, steps))
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")
    assert sync[0] - sync[1] == pytest.approx(steps * delay, rel=0.2), sync
    assert forward[1] >= steps * delay > 2 * forward[0], forward
    last = m.by_rank("syncwatch_last_arrivals_total", train_job=job)
    assert last[1] >= 0.9 * sum(last.values()) and sum(last.values()) >= steps, last
    slack = m.by_rank("syncwatch_slack_seconds_total", train_job=job)
    assert slack[0] / steps == pytest.approx(delay, rel=0.2), slack
    seq = m.by_rank("syncwatch_collective_sequence", train_job=job)
    assert seq[0] == seq[1] > 0, seq


@pytest.mark.parametrize("wrap", ["fully_shard", "fsdp"])
def test_fsdp_results_identical_with_and_without_syncwatch(sock_path, tmp_path, wrap):
    args = ["--wrap", wrap, "--steps", "15", "--slow-rank", "1", "--delay", "0.005"]
    world = 3  # FSDP pads the shards of 3 ranks
    outs = {k: tmp_path / k for k in ("plain", "explicit")}
    for o in outs.values():
        o.mkdir()
    plain = launch(world, [*args, "--out", str(outs["plain"])], tmp_path, "plain")
    finish(plain, tmp_path, "plain")
    explicit = launch(world, [*args, "--instrument", "explicit", "--out", str(outs["explicit"])],
                      tmp_path, "explicit", SYNCWATCH_SOCKET=sock_path, SYNCWATCH_SKEW_EVERY="5")
    finish(explicit, tmp_path, "explicit")
    assert_same_results(outs["plain"], outs["explicit"], world)


def load(out: Path, world: int):
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_same_results(expected: Path, got: Path, world: int) -> None:
    """Each rank's saved weights and last gradients (FSDP: its shards) are bit-identical."""
    for a, b in zip(load(expected, world), load(got, world), strict=True):
        assert a["weights"].keys() == b["weights"].keys() and a["weights"], got
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), (got, k)
        for ga, gb in zip(a["grads"], b["grads"], strict=True):
            assert torch.equal(ga, gb), got


def test_results_identical_with_daemon_absent_killed_and_restarted(sock_path, tmp_path):
    args = ["--steps", "40", "--slow-rank", "1", "--delay", "0.005"]
    world = 3  # not a power of two: 1/3 is inexact, so the arithmetic must match DDP's exactly
    outs = {k: tmp_path / k for k in ("plain", "absent", "restarted")}
    for o in outs.values():
        o.mkdir()
    config = DaemonConfig(listen="127.0.0.1:0", socket=sock_path)
    first = daemon_app.DaemonThread(config)
    second = daemon_app.DaemonThread(config)
    d = first.__enter__()
    restarted = launch(world, [*args, "--instrument", "explicit", "--out", str(outs["restarted"]),
                               "--step-pause", "0.03"], tmp_path, "restarted",
                       SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB="restarted",
                       SYNCWATCH_SKEW_EVERY="10")
    plain = absent = []
    try:
        m = scrape_until(d, lambda m: min(m.by_rank("syncwatch_steps_total").values() or [0]) >= 5,
                         timeout=90)
        steps_before = max(m.by_rank("syncwatch_steps_total").values() or [0])
        assert 5 <= steps_before < 30, "the daemon must go down mid-run"
        first.__exit__(None, None, None)      # daemon killed
        time.sleep(0.3)
        d = second.__enter__()                # and back
        Metrics(d.url)  # Prometheus's first scrape of it, which shows the drops as 0
        finish(restarted, tmp_path, "restarted")
        every = {r: 40.0 for r in range(world)}
        m = scrape_until(d, lambda m: m.by_rank("syncwatch_last_step", train_job="restarted") == every)
        # records resumed; cumulative counters make the new daemon whole (it missed steps)
        assert m.by_rank("syncwatch_last_step", train_job="restarted") == every
        assert m.by_rank("syncwatch_steps_total", train_job="restarted") == every
        assert m.value("syncwatch_client_dropped_records_total") > 0  # sent while it was down
        plain = launch(world, [*args, "--out", str(outs["plain"])], tmp_path, "plain")
        absent = launch(world, [*args, "--instrument", "explicit", "--out", str(outs["absent"])],
                        tmp_path, "absent", SYNCWATCH_SOCKET=str(tmp_path / "nobody.sock"),
                        SYNCWATCH_SKEW_EVERY="10")
        finish(plain, tmp_path, "plain")
        finish(absent, tmp_path, "absent")
    finally:
        for p in plain + absent + restarted:
            p.kill()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
    for kind in ("absent", "restarted"):
        assert_same_results(outs["plain"], outs[kind], world)


def syncwatch_run(job: str, skew_every: int = 0) -> list[str]:
    """The command that runs another under ``syncwatch-run --job job``."""
    return [sys.executable, "-m", "syncwatch.instrument.run", "--job", job, "--skew-every",
            str(skew_every)]


def torchrun(tmp_path: Path, sock_path: str, args: list[str], job: str | None = None,
             world: int = 2, skew_every: int = 0, script: str = WORKER) -> str:
    """Run ``script args`` on ``world`` ranks under torch.distributed.run: unmodified, or under
    ``syncwatch-run --job job`` when a job is given. Asserts it succeeded; returns its output."""
    wrapper = syncwatch_run(job, skew_every) if job else []
    path = tmp_path / f"{job or 'plain'}.log"
    with open(path, "w") as log:
        proc = subprocess.run(
            [*wrapper, sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(world), script, *args],
            env=subprocess_env(SYNCWATCH_SOCKET=sock_path), stdout=log, stderr=subprocess.STDOUT,
            timeout=180)
    text = path.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def zero_code_changes_no_result(tmp_path: Path, sock_path: str, args: list[str], job: str,
                                world: int = 2, skew_every: int = 0) -> None:
    """The script run unmodified and under ``syncwatch-run``: the same weights and gradients
    (FSDP: shards), and none of syncwatch's warnings."""
    outs = {k: tmp_path / k for k in ("plain", "zc")}
    for kind, out in outs.items():
        out.mkdir()
        text = torchrun(tmp_path, sock_path, [*args, "--out", str(out)],
                        job if kind == "zc" else None, world, skew_every)
    assert "syncwatch:" not in text
    assert_same_results(outs["plain"], outs["zc"], world)


def test_zero_code_change_under_syncwatch_run(daemon, sock_path, tmp_path):
    steps, delay = 40, 0.03
    torchrun(tmp_path, sock_path, ["--steps", str(steps), "--slow-rank", "1", "--delay",
                                   str(delay)], "zc", skew_every=10)
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job="zc")
                     == {0: steps, 1: steps})
    assert m.by_rank("syncwatch_steps_total", train_job="zc") == {0: steps, 1: steps}
    assert m.by_rank("syncwatch_samples_total", train_job="zc") == {0: 32 * steps, 1: 32 * steps}
    step_s = m.by_rank("syncwatch_step_seconds_total", train_job="zc")
    # the first step starts at the first forward: rank 1's sleep before it is no step's
    assert min(step_s.values()) >= (steps - 1) * delay
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job="zc", phase="sync")
    assert sync[0] >= 0.8 * steps * delay > sync[1]   # rank 0 waits for the slow rank 1
    # rank 1 sleeps just before calling DDP: in "data" (since the optimizer step), not "forward"
    data = m.by_rank("syncwatch_phase_seconds_total", train_job="zc", phase="data")
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job="zc", phase="forward")
    assert data[1] >= (steps - 1) * delay > data[0]
    assert 0 < forward[1] < 0.5 * steps * delay and forward[0] > 0
    last = m.by_rank("syncwatch_last_arrivals_total", train_job="zc")
    assert last[1] > last[0]
    # the node's histograms observe every step record of both ranks: their step times and their
    # gradient waits (the only collective of a step here, so all of its sync phase)
    assert m.value("syncwatch_step_duration_seconds_count", train_job="zc") == 2 * steps
    assert m.value("syncwatch_step_duration_seconds_sum", train_job="zc") == pytest.approx(
        sum(step_s.values()), rel=1e-9)
    assert m.value("syncwatch_sync_wait_seconds_count", train_job="zc") == 2 * steps
    assert m.value("syncwatch_sync_wait_seconds_sum", train_job="zc") == pytest.approx(
        sum(sync.values()), rel=1e-9)


def test_zero_code_change_under_torch_compile_changes_no_result(daemon, sock_path, tmp_path):
    """torch.compile traces DDP's patched forward (and breaks its graph there): the weights and
    gradients are those of the same compiled script run without syncwatch, and steps are seen."""
    steps = 12
    zero_code_changes_no_result(tmp_path, sock_path, ["--steps", str(steps), "--compile",
                                                      "aot_eager"], "zcc")
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job="zcc")
                     == {0: steps, 1: steps})
    assert m.by_rank("syncwatch_steps_total", train_job="zcc") == {0: steps, 1: steps}
    assert m.by_rank("syncwatch_samples_total", train_job="zcc") == {0: 32 * steps, 1: 32 * steps}
    assert min(m.by_rank("syncwatch_phase_seconds_total", train_job="zcc",
                         phase="forward").values()) > 0
    assert m.value("syncwatch_sync_wait_seconds_count", train_job="zcc") == 2 * steps
    assert m.value("syncwatch_sync_wait_seconds_sum", train_job="zcc") == pytest.approx(sum(
        m.by_rank("syncwatch_phase_seconds_total", train_job="zcc", phase="sync").values()), rel=1e-9)


@pytest.mark.parametrize("wrap", ["fully_shard", "fsdp"])
def test_zero_code_change_with_fsdp(daemon, sock_path, tmp_path, wrap):
    """``syncwatch-run`` on an unmodified FSDP script: the root's forward drives the phases (the
    nested units switch nothing), FSDP's collectives are the sync wait, and the weights and
    gradient shards are those of the same script run without syncwatch."""
    steps, delay, job = 30, 0.05, f"zc-{wrap}"
    zero_code_changes_no_result(tmp_path, sock_path, [
        "--wrap", wrap, "--steps", str(steps), "--slow-rank", "1", "--delay", str(delay)], job,
        skew_every=10)
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_steps_total", train_job=job) == every
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 32 * steps, 1: 32 * steps}
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    # rank 0 waits for the slow rank 1. FSDP1's nested units make several rendezvous a step, and
    # on a loaded 2-core box either rank can be late to one: the margin is that noise (CI measured
    # rank 1 waiting 15 ms a step, rank 0 then 21 ms more than it, with a 30 ms delay)
    assert sync[0] >= 0.8 * steps * delay and sync[0] - sync[1] >= 0.5 * steps * delay, sync
    data = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="data")
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")
    backward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="backward")
    # rank 1 sleeps before calling the model (in "data" from the second step on: the first
    # starts at the first forward, so FSDP's setup since the wrapping is not rank 0's "data")
    assert data[1] >= (steps - 1) * delay > data[0]
    assert 0 < forward[1] < 0.5 * steps * delay and forward[0] > 0 and min(backward.values()) > 0
    last = m.by_rank("syncwatch_last_arrivals_total", train_job=job)
    assert last[1] > last[0]


@pytest.mark.parametrize("wrap,call", [("ddp", "keyword"), ("ddp", "dict"),
                                       ("fully_shard", "keyword")])
def test_zero_code_counts_the_samples_of_a_model_called_by_keyword_or_with_a_dict(
        daemon, sock_path, tmp_path, wrap, call):
    """``model(x=batch)`` (HuggingFace's ``model(**batch)``) and ``model({"x": batch})``: the
    samples are the batch dimension of the tensor given by keyword or in the dict."""
    steps, job = 6, f"zc-{wrap}-{call}"
    text = torchrun(tmp_path, sock_path, ["--wrap", wrap, "--call", call, "--steps", str(steps),
                                          "--batch", "24"], job)
    assert "syncwatch:" not in text
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 24 * steps, 1: 24 * steps}
    assert min(m.by_rank("syncwatch_phase_seconds_total", train_job=job,
                         phase="forward").values()) > 0


@pytest.mark.parametrize("second", ["frozen", "trained"])
def test_zero_code_counts_samples_once_when_a_second_ddp_model_sees_them_too(
        daemon, sock_path, tmp_path, second):
    """A second DDP model runs forward on each batch before the first: a frozen teacher (under
    ``no_grad``: no samples) or one trained alongside (the first model to run counts them). The
    samples are counted once, not twice."""
    steps, job = 6, f"zc-{second}"
    text = torchrun(tmp_path, sock_path, ["--second-model", second, "--steps", str(steps),
                                          "--batch", "24"], job)
    assert "syncwatch:" not in text
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 24 * steps, 1: 24 * steps}
    # a no_grad forward of a model in train mode is no evaluation: its time is not a pause
    assert m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="eval") == {0: 0, 1: 0}


def test_zero_code_counts_no_samples_of_an_evaluation_and_times_it_as_eval(
        daemon, sock_path, tmp_path):
    """An evaluation loop after every 2nd step (``model.eval()``, 3 batches under
    ``torch.no_grad``, 20 ms each besides the forward): its samples are not training samples,
    and its time is ``eval`` (a planned pause), not ``forward``, ``backward`` or ``other``."""
    steps, job = 10, "zc-eval"
    evals = 3 * (steps // 2 - 1)  # batches evaluated within a step (the last follows step 10)
    zero_code_changes_no_result(tmp_path, sock_path, ["--steps", str(steps), "--eval-every", "2",
                                                      "--batch", "24"], job)
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 24 * steps, 1: 24 * steps}
    evaluation = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="eval")
    other = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="other")
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")
    backward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="backward")
    for r in (0, 1):
        assert evaluation[r] >= evals * 0.02 > forward[r] + backward[r] + other[r], (
            evaluation, other, forward, backward)


@pytest.mark.parametrize("saver", ["torch", "dcp"])
def test_zero_code_times_a_save_as_checkpoint(daemon, sock_path, tmp_path, saver):
    """A save after every 3rd step, 50 ms slower than its writes (a slow disk): ``torch.save``
    on rank 0 alone (torch's DDP tutorial) or DCP's ``save`` on both ranks. Its time, as the
    script measures it, is ``checkpoint`` (a planned pause), not ``data``; the save before the
    loop is setup, no step's; rank 1 waits for rank 0's own save in the next gradient sync. The
    weights are those of the same script without syncwatch."""
    steps, job, delay = 10, f"zc-save-{saver}", 0.05
    saves = steps // 3  # after steps 3, 6 and 9, each within the next step
    zero_code_changes_no_result(tmp_path, sock_path, ["--steps", str(steps), "--save-every", "3",
                                                      "--saver", saver], job)
    measured = [r["save_seconds"] for r in load(tmp_path / "zc", 2)]
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_steps_total", train_job=job) == every
    checkpoint = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="checkpoint")
    data = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="data")
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    for r in (0, 1) if saver == "dcp" else (0,):
        assert measured[r] >= saves * delay
        # the state_dict() calls before the save itself are data; with the setup's save the
        # checkpoint time would be a whole save more
        assert measured[r] - 0.01 < checkpoint[r] <= measured[r], (checkpoint, measured)
        assert data[r] < delay, data
    if saver == "torch":
        assert checkpoint[1] == 0 and sync[1] >= 0.8 * saves * delay > sync[0], (checkpoint, sync)
    # one each, whatever DCP's writer saves inside (a torch.save per item: 3 and 7 counted)
    assert m.value("syncwatch_checkpoints_total", train_job=job) == saves


@pytest.mark.parametrize("order", ["init-after-model", "init-first"])
def test_a_script_that_instruments_itself_under_syncwatch_run_is_counted_once(
        daemon, sock_path, tmp_path, order):
    """The explicit API under ``syncwatch-run`` (a cluster that wraps every job): zero-code mode
    stands down once the script calls ``init()``, before or after building its model. Both
    reported side by side: 20 steps and 640 samples for 10 steps of 32, and the script's step
    numbers, going back to its count each time, read as a restart every step (10 restarts)."""
    steps, job = 10, f"zc-explicit-{order}"
    extra = ["--init-first"] if order == "init-first" else []
    torchrun(tmp_path, sock_path, ["--instrument", "explicit", "--steps", str(steps), *extra], job)
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_steps_total", train_job=job) == every
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 32 * steps, 1: 32 * steps}
    assert m.value("syncwatch_job_restarts_total", train_job=job) == 0
    assert m.by_rank("syncwatch_last_step", train_job=job) == every  # the script's own numbers
    assert m.value("syncwatch_client_internal_errors_total") == 0


def test_zero_code_ends_the_steps_that_a_grad_scaler_skips(daemon, sock_path, tmp_path):
    """An fp16-style loop through ``GradScaler``: at the steps whose gradients are infinite its
    ``step()`` skips the optimizer's, and those iterations are steps all the same (they were
    merged into the next one). The weights are those of the same script without syncwatch."""
    steps, job = 10, "zc-amp"
    zero_code_changes_no_result(tmp_path, sock_path, ["--steps", str(steps), "--amp-skip", "2",
                                                      "3", "7"], job)
    every = {0: steps, 1: steps}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == every)
    assert m.by_rank("syncwatch_steps_total", train_job=job) == every
    assert m.by_rank("syncwatch_samples_total", train_job=job) == {0: 32 * steps, 1: 32 * steps}
    assert min(m.by_rank("syncwatch_phase_seconds_total", train_job=job,
                         phase="optimizer").values()) > 0


def test_rank_stuck_in_a_collective_stays_alive_and_behind(daemon, sock_path, tmp_path):
    job = "hang"
    procs = launch(4, ["--instrument", "explicit", "--steps", "100", "--hang-rank", "1",
                       "--hang-step", "5", "--bucket-mb", "0.05"], tmp_path, job,
                   SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job, SYNCWATCH_HEARTBEAT="0.2")
    try:
        def stuck(m):
            el = m.by_rank("syncwatch_rank_phase_elapsed_seconds", train_job=job, phase="sync")
            return len(el) == 4 and min(el.values()) >= 1.0
        m1 = scrape_until(daemon, stuck, timeout=60)
        assert stuck(m1), m1.get("syncwatch_rank_phase_elapsed_seconds")
        time.sleep(1.0)
        m2 = Metrics(daemon.url)
        assert all(p.poll() is None for p in procs)  # nobody crashed: they are blocked
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert m2.by_rank("syncwatch_last_step", train_job=job) == {r: 5.0 for r in range(4)}
    ts1 = m1.by_rank("syncwatch_last_step_timestamp_seconds", train_job=job)
    assert m2.by_rank("syncwatch_last_step_timestamp_seconds", train_job=job) == ts1  # stalled
    el1 = m1.by_rank("syncwatch_rank_phase_elapsed_seconds", train_job=job, phase="sync")
    el2 = m2.by_rank("syncwatch_rank_phase_elapsed_seconds", train_job=job, phase="sync")
    assert all(el2[r] >= el1[r] + 0.5 for r in range(4))     # heartbeats keep coming
    seq = m2.by_rank("syncwatch_collective_sequence", train_job=job)
    assert seq[1] < min(seq[r] for r in (0, 2, 3)), seq     # the rank behind


def test_restart_resuming_from_an_earlier_step_counts_rerun_steps(daemon, sock_path, tmp_path):
    job = "elastic"
    env = dict(SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="0")
    first = launch(1, ["--instrument", "explicit", "--steps", "30"], tmp_path, "attempt0", **env)
    finish(first, tmp_path, "attempt0")
    second = launch(1, ["--instrument", "explicit", "--steps", "30", "--start-step", "20"],
                    tmp_path, "attempt1", TORCHELASTIC_RESTART_COUNT="1", **env)
    finish(second, tmp_path, "attempt1")
    m = scrape_until(daemon, lambda m: m.value("syncwatch_last_step", train_job=job) == 50)
    assert m.value("syncwatch_last_step", train_job=job) == 50
    assert m.value("syncwatch_job_attempt", train_job=job) == 1
    assert m.value("syncwatch_job_restarts_total", train_job=job) == 1
    assert m.value("syncwatch_job_rerun_steps_total", train_job=job) == 10  # steps 21..30 again


SUBSET_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
solo = dist.new_group([0])
if dist.get_rank() == 0:  # an auxiliary model of rank 0's own
    model = DistributedDataParallel(torch.nn.Linear(8, 8), process_group=solo)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


def test_zero_code_with_a_model_that_only_some_ranks_build(daemon, sock_path, tmp_path):
    """Rank 0 alone trains a DDP model over a group of its own, then every rank meets in a
    barrier. Zero-code mode made the skew exchange's side group at that model, a collective of
    the whole world that rank 1 never joins: rank 0 waited there, rank 1 in the barrier, until
    the timeout killed the job. Now that model starts the monitor without the exchange."""
    script = tmp_path / "subset.py"
    script.write_text(SUBSET_SCRIPT)
    job = "zc-subset"
    text = torchrun(tmp_path, sock_path, [], job, skew_every=2, script=str(script))
    assert "the first model's process group is a part of the world" in text
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job) == {0: 5})
    assert m.by_rank("syncwatch_steps_total", train_job=job) == {0: 5}
    assert m.value("syncwatch_client_internal_errors_total") == 0


SHARED_JOB_SCRIPT = """
import os, sys, time, torch.distributed as dist
import syncwatch.instrument as sw
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    time.sleep(1.0)
start = time.monotonic()
m = sw.init(exchange_every=0) if rank == 1 or sys.argv[1] == "all" else None
print(m.identity.train_job if m else "-", time.monotonic() - start, flush=True)
dist.barrier()
sw.shutdown()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("who", ["all", "rank 1 only"])
def test_a_generated_job_name_is_shared_without_waiting_for_rank_0(sock_path, tmp_path, who):
    """No job name in the environment (a launcher other than torchrun or Slurm): every rank
    that calls ``init()`` takes the same generated name from the store, and none waits for
    another (rank 0 generated it and the others waited up to 30 s for it on the training
    thread, however late or absent rank 0 was)."""
    script = tmp_path / "shared_job.py"
    script.write_text(SHARED_JOB_SCRIPT)
    procs = launch(2, [who.split()[0]], tmp_path, "shared", script=str(script),
                   SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB="", TORCHELASTIC_RUN_ID="",
                   SLURM_JOB_ID="")  # empty: no job name from a launcher
    finish(procs, tmp_path, "shared")
    outs = [(tmp_path / f"shared-rank{r}.log").read_text() for r in (0, 1)]
    (job0, _), (job1, seconds1) = (o.strip().splitlines()[-1].split() for o in outs)
    assert job1.startswith("job-") and job0 == (job1 if who == "all" else "-")
    assert float(seconds1) < 10  # rank 0, a second late or never there, held nobody up


def test_zero_code_resuming_from_a_checkpoint_counts_the_steps_run_again(
        daemon, sock_path, tmp_path):
    """An unmodified job whose rank 0 fails after step 25 restarts (attempt 1), resumes from its
    save after step 20 (AdamW's state, with its step count) and runs to step 40, under
    ``syncwatch-run``. Each attempt counted its steps from 1 where nothing told it the job's:
    the daemon took all 25 steps of the first attempt for re-run ones. The weights are those
    of the same run without syncwatch."""
    job = "zc-resume"
    outs = {}
    for kind in ("plain", "zc"):
        outs[kind] = out = tmp_path / kind
        out.mkdir()
        wrapper = syncwatch_run(job) if kind == "zc" else []
        for attempt in (0, 1):
            tag = f"{kind}{attempt}"
            procs = launch(2, ["--ckpt", str(out / "ckpt.pt"), "--out", str(out)], tmp_path, tag,
                           script=RESUME_WORKER, wrapper=wrapper, SYNCWATCH_SOCKET=sock_path,
                           TORCHELASTIC_RESTART_COUNT=str(attempt))
            if attempt == 0:  # rank 0 fails; rank 1 then finds its peer gone
                try:
                    assert procs[0].wait(90) == 1 and procs[1].wait(30) != 0
                finally:
                    for p in procs:
                        p.kill()
                assert "injected failure after step 25" in (tmp_path / f"{tag}-rank0.log").read_text()
            else:
                finish(procs, tmp_path, tag)
    assert_same_results(outs["plain"], outs["zc"], 2)
    every = {0: 40, 1: 40}
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_last_step", train_job=job) == every)
    assert m.by_rank("syncwatch_last_step", train_job=job) == every  # the job's own numbers
    assert m.value("syncwatch_job_attempt", train_job=job) == 1
    assert m.value("syncwatch_job_restarts_total", train_job=job) == 1
    assert m.value("syncwatch_job_rerun_steps_total", train_job=job) == 5  # steps 21..25 again
    assert m.value("syncwatch_client_internal_errors_total") == 0


def test_a_slurm_requeue_of_torchrun_is_a_later_attempt(daemon, sock_path, tmp_path):
    """Slurm requeues a job whose torchrun had restarted its workers twice: the new torchrun's
    restart count is 0 again. The attempt went back from 2 to 0 and the daemon ignored the
    requeued job's records as stale ones of an older attempt (for --rank-ttl, or --job-grace after
    the end record); it must read as the next attempt, a restart with its re-run steps."""
    job = "requeued"
    env = dict(SYNCWATCH_SOCKET=sock_path, SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="0",
               TORCHELASTIC_MAX_RESTARTS="3")
    first = launch(1, ["--instrument", "explicit", "--steps", "30"], tmp_path, "slurm0",
                   SLURM_RESTART_COUNT="0", TORCHELASTIC_RESTART_COUNT="2", **env)
    finish(first, tmp_path, "slurm0")
    scrape_until(daemon, lambda m: m.value("syncwatch_last_step", train_job=job) == 30)
    second = launch(1, ["--instrument", "explicit", "--steps", "30", "--start-step", "20"],
                    tmp_path, "slurm1", SLURM_RESTART_COUNT="1", TORCHELASTIC_RESTART_COUNT="0",
                    **env)
    finish(second, tmp_path, "slurm1")
    m = scrape_until(daemon, lambda m: m.value("syncwatch_last_step", train_job=job) == 50)
    assert m.value("syncwatch_last_step", train_job=job) == 50
    assert m.value("syncwatch_job_attempt", train_job=job) == 4  # Slurm's 1 x (3 + 1) + 0
    assert m.value("syncwatch_job_restarts_total", train_job=job) == 1
    assert m.value("syncwatch_job_rerun_steps_total", train_job=job) == 10


@pytest.mark.gpu
def test_a_device_straggler_is_named_on_the_cuda_clock(sock_path, tmp_path):
    """CUDA (skipped without a GPU): two gloo ranks train on the GPU, and rank 1's forward queues
    a kernel that spins ``delay`` on the device while its host goes on. Timed on CUDA events,
    rank 1's forward holds the delay, rank 0 waits it in the gradient sync, and the exchange
    names rank 1 (on a host clock both ranks' hosts wait in the sync, and neither forward is
    slow). The daemon reads the GPUs through the real NVML, and each rank's GPU UUID is one
    of NVML's: the join of the ranks to their GPUs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from syncwatch.collectors import CollectorRunner
    from syncwatch.collectors.gpu import GpuCollector
    job, steps, delay = "cuda-straggler", 60, 0.02
    gpus = CollectorRunner({"gpu": GpuCollector()}, interval=0.5, timeout=5)
    with daemon_app.DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock_path),
                                 extra_collectors=[gpus]) as daemon:
        procs = launch(2, ["--steps", str(steps), "--slow-rank", "1", "--delay", str(delay)],
                       tmp_path, job, script=CUDA_WORKER, SYNCWATCH_SOCKET=sock_path,
                       SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="20", SYNCWATCH_DEVICE="cuda")
        finish(procs, tmp_path, job, timeout=180)
        m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                         == {0: steps, 1: steps} and every_window_in(m, job, steps))
    assert m.by_rank("syncwatch_steps_total", train_job=job) == {0: steps, 1: steps}
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")
    spun = (forward[1] - forward[0]) / steps  # the device delay as rank 1's forward timed it
    assert spun == pytest.approx(delay, rel=0.3), forward
    assert sync[0] / steps == pytest.approx(spun, rel=0.25), (sync, spun)
    assert sync[1] / steps < 0.25 * spun, (sync, spun)
    last = m.by_rank("syncwatch_last_arrivals_total", train_job=job)
    exchanged = sum(last.values())
    assert last[1] >= 0.9 * exchanged, last
    slack = m.by_rank("syncwatch_slack_seconds_total", train_job=job)
    assert slack[0] / exchanged == pytest.approx(spun, rel=0.25), (slack, spun)
    ranks = {s.labels["uuid"] for s in m.get("syncwatch_rank_info", train_job=job)}
    nvml = {s.labels["uuid"] for s in m.get("syncwatch_gpu_up") if s.value == 1}
    assert ranks and ranks <= nvml, (ranks, nvml)


@pytest.mark.gpu
def test_an_async_collectives_wait_under_nccl_is_sync_on_the_device(sock_path, tmp_path):
    """CUDA (skipped without a GPU): one NCCL rank's forward spins ``delay`` on a side stream,
    launches an ``async_op`` all-reduce there, and waits on its work. Under NCCL ``wait()`` does
    not block the host: it makes the current stream wait for NCCL's, which waits for the spin.
    The wrapped ``Work.wait`` marks both sides of it on the current stream, so the device's wait
    is ``sync``, not the forward's (the host returns at once, so a host clock saw no wait)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    job, steps, delay = "async-nccl", 30, 0.02
    with daemon_app.DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=sock_path)) as daemon:
        procs = launch(1, ["--steps", str(steps), "--backend", "nccl", "--async-wait",
                           "--slow-rank", "0", "--delay", str(delay)],
                       tmp_path, job, script=CUDA_WORKER, SYNCWATCH_SOCKET=sock_path,
                       SYNCWATCH_JOB=job, SYNCWATCH_SKEW_EVERY="0")
        finish(procs, tmp_path, job, timeout=180)
        m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                         == {0: steps})
    sync = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="sync")[0]
    forward = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")[0]
    assert sync / steps == pytest.approx(delay, rel=0.3), (sync, forward)
    assert forward < 0.3 * sync, (sync, forward)
    # each step: the async all-reduce and DDP's one bucket
    assert m.by_rank("syncwatch_collective_sequence", train_job=job)[0] >= 2 * steps


@pytest.mark.gpu
def test_zero_code_under_nccl_times_on_the_gpu(daemon, sock_path, tmp_path):
    """CUDA (skipped without a GPU): an unmodified NCCL DDP script, one rank, under
    ``syncwatch-run``. NCCL makes CUDA events the clock by default: the kernel that spins
    ``delay`` on the device before each call of the model, which the host only queues, is the
    step's ``data`` time (since the optimizer step), and the rank reports its GPU's UUID."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from syncwatch.instrument.identity import cuda_uuid
    job, steps, delay = "zc-nccl", 30, 0.02
    torchrun(tmp_path, sock_path, ["--steps", str(steps), "--backend", "nccl", "--instrument",
                                   "none", "--slow-rank", "0", "--delay", str(delay)],
             job, world=1, script=CUDA_WORKER)
    m = scrape_until(daemon, lambda m: m.by_rank("syncwatch_steps_total", train_job=job)
                     == {0: steps})
    assert m.by_rank("syncwatch_steps_total", train_job=job) == {0: steps}
    data = m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="data")[0]
    # the first step starts at the first forward: the spin before it is no step's
    assert 0.7 * (steps - 1) * delay <= data <= 1.3 * steps * delay, data
    assert m.by_rank("syncwatch_phase_seconds_total", train_job=job, phase="forward")[0] > 0
    (info,) = m.get("syncwatch_rank_info", train_job=job)
    assert info.labels["uuid"] == cuda_uuid(0) != ""
