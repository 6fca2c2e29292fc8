"""``syncwatch demo`` as a user runs it: a child process with real daemons, scraped while it runs."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import subprocess_env


def test_demo_serves_live_metrics_and_prints_a_summary():
    cmd = [sys.executable, "-m", "syncwatch", "demo", "--scenario", "straggler", "--nodes", "2",
           "--ranks-per-node", "3", "--base-port", "0", "--duration", "5", "--step-time", "0.05",
           "--summary-every", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    try:
        urls = []
        while len(urls) < 2:
            line = proc.stdout.readline()
            assert line, f"demo exited early: {proc.stderr.read()}"
            urls += re.findall(r"scrape (http://127\.0\.0\.1:\d+)/metrics", line)
        # node 1's daemon holds ranks 3..5; their step counters grow while the demo runs
        deadline = time.monotonic() + 10
        while True:
            body = urllib.request.urlopen(urls[1] + "/metrics", timeout=5).read().decode()
            m = re.search(r'syncwatch_steps_total\{rank="4",train_job="sim-straggler"\} (\S+)', body)
            if m and float(m.group(1)) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert m and float(m.group(1)) >= 3, body[:2000]
        assert 'node="sim-node-01"' in body
        # simulated hardware (on by default): the straggler (rank 5 = node 1, local rank 2) runs on
        # a hot, thermally throttled GPU whose uuid is the one its rank reports
        assert 'rank="5",train_job="sim-straggler",uuid="GPU-sim-node-01-2"' in body
        hot = r'syncwatch_gpu_throttle_active\{gpu="2",reason="sw_thermal",uuid="GPU-sim-node-01-2"\} 1\.0'
        while not re.search(hot, body) and time.monotonic() < deadline + 5:
            time.sleep(0.2)
            body = urllib.request.urlopen(urls[1] + "/metrics", timeout=5).read().decode()
        assert re.search(hot, body), body[:4000]
        assert 'syncwatch_roce_cnp_handled_total{device="mlx5_0",port="1"}' in body
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = [ln for ln in out.splitlines() if "steps/s" in ln]
    assert len(lines) >= 2
    assert "last arrival: rank 5 (sim-node-01)" in lines[-1]  # the straggler scenario's rank


def test_demo_hardware_flag_and_its_env_twin(monkeypatch):
    from syncwatch import cli
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"demo": "syncwatch.sim.demo"})
    assert cli.build_parser().parse_args(["demo"]).hardware is True
    assert cli.build_parser().parse_args(["demo", "--no-hardware"]).hardware is False
    monkeypatch.setenv("SYNCWATCH_DEMO_HARDWARE", "off")
    assert cli.build_parser().parse_args(["demo"]).hardware is False
    assert cli.build_parser().parse_args(["demo", "--hardware"]).hardware is True


def _doc_row(path: Path, label: str) -> list[str]:
    """The five CVs of the calibration table's row ``label`` in ``path``."""
    (row,) = [ln for ln in path.read_text().splitlines() if ln.startswith(f"| {label} |")]
    return [c.strip() for c in row.strip("|").split("|")[1:]]


def test_demo_scaling_prints_cv_against_the_paper_and_the_docs_rows():
    """The sweep, and with --ablations the comparison sweeps, as the calibration tables give them:
    their two comparison rows no longer matched any output (nothing printed them)."""
    out = subprocess.run([sys.executable, "-m", "syncwatch", "demo", "--scenario", "scaling",
                          "--ablations"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    tables = out.stdout.split("\n\n")
    assert [t.splitlines()[0] for t in tables[1:]] == ["Gaussian jitter only:", "+ stalls, no congestion:"]
    rows = [[ln.split() for ln in t.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s", ln)]
            for t in tables]
    for table in rows:
        assert [int(r[0]) for r in table] == [4, 8, 16, 32, 64]
        assert [float(r[4]) for r in table] == [0.02, 0.04, 0.09, 0.15, 0.22]
    cvs = [float(r[3]) for r in rows[0]]
    assert cvs == sorted(cvs)
    root = Path(__file__).resolve().parents[1]
    sim, readme = root / "docs" / "simulator.md", root / "README.md"
    printed = [[r[3] for r in table] for table in rows]
    assert _doc_row(sim, "syncwatch model, seed 0") == printed[0]
    assert _doc_row(readme, "`syncwatch demo --scenario scaling` (seed 0)") == printed[0]
    assert _doc_row(sim, "Gaussian jitter only") == printed[1]
    assert _doc_row(readme, "Gaussian jitter only (`--ablations`)") == printed[1]
    assert _doc_row(sim, "+ stalls, no congestion") == printed[2]


def test_demo_ablations_go_with_the_scaling_sweep_only(capsys):
    from syncwatch import cli
    assert cli.main(["demo", "--ablations", "--base-port", "0", "--duration", "1"]) == 2
    assert capsys.readouterr().err.strip() == "syncwatch demo: --ablations goes with --scenario scaling"


def test_demo_reports_a_taken_port_clearly():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "syncwatch", "demo", "--nodes", "1",
                              "--base-port", str(port), "--duration", "1"],
                             capture_output=True, text=True, env=subprocess_env(), timeout=30)
    assert out.returncode == 2
    assert f"127.0.0.1:{port}" in out.stderr and "--base-port" in out.stderr


def test_demo_points_at_the_listen_host_when_it_cannot_bind_there(capsys):
    """An address not on this machine is no port conflict: the hint names --listen-host."""
    from syncwatch import cli
    assert cli.main(["demo", "--listen-host", "192.0.2.1", "--base-port", "0", "--no-hardware",
                     "--nodes", "1", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert "192.0.2.1:0" in err and "--listen-host" in err and "--base-port" not in err


@pytest.mark.parametrize("flags", [["--step-time", "nan"], ["--step-time", "inf"],
                                   ["--step-time", "-1"], ["--duration", "-5"],
                                   ["--summary-every", "0"], ["--nodes", "0"], ["--ranks-per-node", "0"],
                                   ["--ranks-per-node", "1025"],
                                   ["--job", "my job"], ["--job", "x" * 129],
                                   ["--base-port", "-5"], ["--base-port", "65534", "--nodes", "3"]])
def test_demo_refuses_bad_arguments_before_starting_anything(flags, capsys):
    """A NaN step time ran a demo whose every record the daemons rejected (NaN durations), a
    negative duration stopped it at once after announcing it, a zero summary period printed the
    summary ten times a second, a --job outside the label alphabet died in a traceback once the
    daemons were up, and so did a --base-port whose ports leave 1..65535 and more than 1024 ranks
    per node (a GPU index the protocol refuses: ProtocolError bad_identity)."""
    from syncwatch import cli
    assert cli.main(["demo", "--base-port", "0", "--no-hardware", "--duration", "1", *flags]) == 2
    assert "syncwatch demo:" in capsys.readouterr().err


def test_demo_refuses_a_step_time_beyond_the_protocols_limit(capsys):
    """--step-time 5e5 ran a demo whose steps reach 1.5e6 s (a capped stall in a congestion
    episode), beyond the 1e6 s the daemons take: each such record rejected, the truth counting
    it. It is refused before anything starts, with the limit and the most it allows."""
    from syncwatch import cli
    assert cli.main(["demo", "--base-port", "0", "--no-hardware", "--duration", "1",
                     "--step-time", "5e5"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("syncwatch demo: --step-time 500000: compute_seconds must keep steps "
                          "within the protocol's 1e+06-second limit on a duration") and not out
    assert "at most 3.206e+05 does" in err


@pytest.mark.parametrize("ranks", ["0", "-3"])
def test_demo_scaling_refuses_a_bad_ranks_per_node(ranks, capsys):
    """The scaling sweep returned before the flags were checked: --ranks-per-node 0 was a
    traceback (ValueError from the model, exit 1)."""
    from syncwatch import cli
    assert cli.main(["demo", "--scenario", "scaling", "--ranks-per-node", ranks]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "syncwatch demo: --ranks-per-node must be at least 1" and not out


@pytest.mark.parametrize("env, says", [
    ({"SYNCWATCH_DEMO_RANKS_PER_NODE": "0"},
     "--ranks-per-node (from SYNCWATCH_DEMO_RANKS_PER_NODE) must be at least 1"),
    ({"SYNCWATCH_DEMO_NODES": "0"}, "--nodes (from SYNCWATCH_DEMO_NODES) and --step-time must be "
                                    "positive (and finite)"),
    ({"SYNCWATCH_DEMO_ABLATIONS": "1"}, "--ablations (from SYNCWATCH_DEMO_ABLATIONS) goes with "
                                        "--scenario scaling"),
    ({"SYNCWATCH_DEMO_JOB": "a b"}, "--job (from SYNCWATCH_DEMO_JOB) 'a b' is not a train_job "
                                    "label: 1 to 128 of A-Z a-z 0-9 _ . : @ / + = -"),
])
def test_demo_names_the_variable_a_bad_value_came_from(env, says, monkeypatch, capsys):
    """Each named its flag alone, where no flag had been typed: the value came from the
    SYNCWATCH_DEMO_* variable."""
    from syncwatch import cli
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(["demo", "--duration", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"syncwatch demo: {says}" and not out


def test_demo_announces_step_time_as_the_compute_it_is(capsys):
    """--step-time is each rank's compute a step (its help's words); a step also holds the
    collective (0.15 x compute) after the last arrival. The banner called it the step time
    ('step time ~0.05s') above summary lines reading 'step 0.058s'."""
    from syncwatch import cli
    assert cli.main(["demo", "--scenario", "healthy", "--base-port", "0", "--nodes", "1",
                     "--ranks-per-node", "2", "--no-hardware", "--step-time", "0.05",
                     "--duration", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "compute ~0.05s a step" in out.splitlines()[0]
    step = float(re.search(r"  step (\S+)s  ", out.splitlines()[-1]).group(1))
    assert step >= 0.05 * 1.1


def test_demo_stopped_while_it_starts_cleans_up(monkeypatch, capsys):
    """A stop signal between the simulation's set-up and its start (the hardware following the
    driver here) stops the demo as any other: the summary, exit status 0, the daemons stopped
    and the socket and hardware directories removed. It raised UnboundLocalError (no start time
    yet), then RuntimeError (joining a thread never started) and left both directories."""
    from syncwatch import cli
    from syncwatch.sim import hardware

    made = []

    def interrupted(self, driver):
        made.append(self.dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(hardware.SimulatedHardware, "follow", interrupted)
    assert cli.main(["demo", "--base-port", "0", "--nodes", "1", "--ranks-per-node", "1",
                     "--duration", "5"]) == 0
    out = capsys.readouterr().out
    assert "waiting for the first step" in out
    sock_dir = os.path.dirname(re.search(r"\(ingest (\S+\.sock)\)", out).group(1))
    assert not os.path.exists(sock_dir) and made and not made[0].exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_demo_stops_cleanly_on_a_stop_signal(sig):
    """``syncwatch demo &`` is stopped with ``kill`` (SIGTERM), a closed terminal sends SIGHUP:
    both must stop it as Ctrl-C does, with the daemons stopped and the socket directory removed."""
    cmd = [sys.executable, "-m", "syncwatch", "demo", "--nodes", "2", "--ranks-per-node", "2",
           "--base-port", "0", "--step-time", "0.05", "--no-hardware"]
    # as from a terminal: under a shell that ran the tests in the background, SIGINT comes
    # ignored, and Python keeps it so (the demo then cannot see Ctrl-C, as documented)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        head = ""
        while "Ctrl-C stops." not in head:
            line = proc.stdout.readline()
            assert line, f"demo exited early: {proc.stderr.read()}"
            head += line
        sock_dir = os.path.dirname(re.search(r"\(ingest (\S+\.sock)\)", head).group(1))
        assert os.path.basename(sock_dir).startswith("syncwatch-demo-")
        assert sorted(os.listdir(sock_dir)) == ["node00.sock", "node01.sock"]
        time.sleep(1.0)  # some steps, so the closing summary has figures
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    left = os.path.exists(sock_dir)
    shutil.rmtree(sock_dir, ignore_errors=True)  # do not litter /tmp when it fails
    assert not left, f"{sock_dir} left behind"
    assert "steps/s" in out  # the closing summary: it went through the clean stop
