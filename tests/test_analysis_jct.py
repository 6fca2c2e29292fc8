"""``syncwatch jct``: the Hockney, Young/Daly and order-statistics models and the estimate."""

from __future__ import annotations

import math
import re

import pytest

from analysis_helpers import run_cli, run_json
from syncwatch import cli
from syncwatch.analysis import checkpoint as ck
from syncwatch.analysis.collectives import (hierarchical_allreduce_seconds, ring_allreduce_seconds,
                                            tree_allreduce_seconds)
from syncwatch.analysis.jct import JobSpec, estimate
from syncwatch.analysis.orderstats import expected_normal_max, normal_max_moments

GBIT = 1e9 / 8
DAY = 86400.0


# ---- worked figures of the issue

def test_137_gb_at_400_gbit_takes_about_27_ms():
    # one message of N bytes is N / beta; a ring all-reduce between two GPUs moves exactly that:
    # 2 (P-1) N / (P beta) = N / beta
    assert ring_allreduce_seconds(1.37e9, 2, 400 * GBIT) == pytest.approx(0.0274, abs=1e-4)


def test_young_interval_30s_at_24h_is_about_2276s():
    tau = ck.young_interval(30, DAY)
    assert tau == pytest.approx(2276.8, abs=0.5)
    assert tau / 60 == pytest.approx(38, abs=0.5)


def test_young_interval_512s_at_24h_is_about_940s():
    assert ck.young_interval(5.12, DAY) == pytest.approx(940.6, abs=0.5)


def test_worked_figures_through_the_cli(monkeypatch, capsys):
    out = run_json(monkeypatch, capsys, [
        "jct", "--flops", "1e18", "--steps", "100", "--nodes", "2", "--gpus-per-node", "1",
        "--sustained-tflops", "100", "--grad-bytes", "1.37G", "--net-gbits", "400",
        "--net-latency-us", "0", "--checkpoint-seconds", "30", "--mtbf-hours", "24",
        "--checkpoint-interval", "young"])["estimate"]
    assert out["allreduce_inter_seconds"] == pytest.approx(0.0274, abs=1e-4)
    assert out["checkpoint_interval_seconds"] == pytest.approx(2276.8, abs=0.5)
    assert out["young_interval_seconds"] == pytest.approx(2276.8, abs=0.5)


# ---- collective models

def test_ring_bandwidth_term_tends_to_2n_over_beta_and_latency_grows_linearly():
    n, beta = 1e9, 50e9
    assert ring_allreduce_seconds(n, 4, beta) == pytest.approx(2 * 3 * n / (4 * beta))
    assert ring_allreduce_seconds(n, 10_000, beta) == pytest.approx(2 * n / beta, rel=1e-3)
    lat = ring_allreduce_seconds(0, 101, beta, 1e-5)
    assert lat == pytest.approx(2 * 100 * 1e-5)
    assert ring_allreduce_seconds(n, 1, beta, 1e-5) == 0.0


def test_tree_pays_log_latency_but_moves_the_whole_message_per_level():
    n, beta, alpha = 1e9, 50e9, 1e-5
    assert tree_allreduce_seconds(n, 8, beta, alpha) == pytest.approx(2 * 3 * (alpha + n / beta))
    assert tree_allreduce_seconds(n, 9, beta, alpha) == pytest.approx(2 * 4 * (alpha + n / beta))
    # small message at large scale: tree wins; large message: ring wins
    assert tree_allreduce_seconds(1e3, 4096, beta, alpha) < ring_allreduce_seconds(1e3, 4096, beta, alpha)
    assert tree_allreduce_seconds(1e9, 4096, beta, alpha) > ring_allreduce_seconds(1e9, 4096, beta, alpha)


def test_hierarchical_reduces_to_its_tiers():
    kw = dict(intra_bandwidth=400e9, intra_latency=2e-6, inter_bandwidth=50e9, inter_latency=1e-5)
    intra, inter = hierarchical_allreduce_seconds(1e9, 1, 16, **kw)
    assert intra == 0 and inter == pytest.approx(ring_allreduce_seconds(1e9, 16, 50e9, 1e-5))
    intra, inter = hierarchical_allreduce_seconds(1e9, 8, 1, **kw)
    assert inter == 0 and intra == pytest.approx(ring_allreduce_seconds(1e9, 8, 400e9, 2e-6))
    # 8 local ranks: each GPU sends only its 1/8 shard across the network
    _, inter8 = hierarchical_allreduce_seconds(1e9, 8, 16, **kw)
    assert inter8 == pytest.approx(ring_allreduce_seconds(1e9 / 8, 16, 50e9, 1e-5))


# ---- checkpoint models

def test_daly_refines_young_slightly_below_it_and_caps_at_mtbf():
    young, daly = ck.young_interval(30, DAY), ck.daly_interval(30, DAY)
    expected = math.sqrt(2 * 30 * DAY) * (1 + math.sqrt(30 / (2 * DAY)) / 3 + 30 / (18 * DAY)) - 30
    assert daly == pytest.approx(expected)
    assert 0.98 * young < daly < young
    assert ck.daly_interval(3 * DAY, DAY) == DAY


def test_daly_wall_time_matches_its_first_order_form_when_everything_is_small():
    w, tau, d, r, m = 1e6, 2000.0, 30.0, 600.0, 1e7
    first_order = w * (1 + d / tau) * (1 + (r + (tau + d) / 2) / m)
    assert ck.daly_wall_seconds(w, tau, d, r, m) == pytest.approx(first_order, rel=1e-3)
    assert ck.daly_wall_seconds(w, tau, d, r, None) == pytest.approx(w * (1 + d / tau))


def test_optimal_interval_minimizes_daly_wall_time():
    w, d, r, m = 1e6, 30.0, 600.0, DAY
    best = ck.daly_interval(d, m)
    t_best = ck.daly_wall_seconds(w, best, d, r, m)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert ck.daly_wall_seconds(w, best * factor, d, r, m) > t_best


# ---- order statistics

@pytest.mark.parametrize("n, value", [(2, 1 / math.sqrt(math.pi)), (8, 1.4236), (64, 2.3429),
                                      (512, 3.0439), (4096, 3.6261), (16384, 3.9714)])
def test_expected_maximum_of_normals(n, value):
    assert expected_normal_max(n) == pytest.approx(value, abs=2e-3)


def test_maximum_concentrates_as_n_grows():
    sds = [normal_max_moments(n)[1] for n in (2, 8, 64, 512)]
    assert sds == sorted(sds, reverse=True)


# ---- the estimate

BASE = dict(nodes=16, gpus_per_node=8, sustained_tflops=400.0, params=7e9, tokens=1e12,
            batch_tokens=4096 * 1024, t_drain=0, t_download=0, t_reinit=0, t_provision=0)


def test_pure_compute_job_runs_at_its_theoretical_minimum():
    e = estimate(JobSpec(**{**BASE, "nodes": 1, "gpus_per_node": 1}))
    assert e.theoretical_min_seconds == pytest.approx(6 * 7e9 * 1e12 / 400e12)
    assert e.predicted_seconds == pytest.approx(e.theoretical_min_seconds)
    assert e.efficiency == pytest.approx(1.0)
    assert e.reading.startswith("compute-bound")


def test_a_job_between_communication_and_compute_bound_reads_balanced():
    """One node of TP 4 x PP 2 (one replica: no all-reduce) with 4 micro-batches loses a quarter
    of its compute to the pipeline bubble: 80 % efficient, between the 70 % of communication-bound
    and the 85 % of compute-bound."""
    e = estimate(JobSpec(**{**BASE, "nodes": 1}, tp=4, pp=2, microbatches=4))
    assert e.exposed_comm_seconds == 0 and e.efficiency == pytest.approx(0.8)
    assert e.reading == "balanced (70-85 %)"


def test_the_all_reduce_inside_a_node_spans_its_data_parallel_ranks_only():
    """One node of 8 GPUs in 2 pipeline stages holds 4 replicas of each stage: the gradient is
    all-reduced among those 4 over NVLink, not among all 8 GPUs of the node, and nothing crosses
    the network."""
    e = estimate(JobSpec(**{**BASE, "nodes": 1}, pp=2, microbatches=8))
    assert (e.dp, e.dp_local, e.dp_nodes) == (4, 4, 1)
    grad = 7e9 / 2 * 2.0
    assert e.allreduce_intra_seconds == pytest.approx(ring_allreduce_seconds(grad, 4, 450e9, 2e-6))
    assert e.allreduce_inter_seconds == 0


def test_pipeline_bubble_is_p_minus_1_over_m_and_accumulation_shrinks_it():
    e = estimate(JobSpec(**BASE, pp=4, microbatches=16))
    assert e.bubble_seconds == pytest.approx(e.compute_seconds * 3 / 16)
    more = estimate(JobSpec(**BASE, pp=4, microbatches=64))
    assert more.bubble_seconds == pytest.approx(e.bubble_seconds / 4)
    # gradient accumulation: one all-reduce per optimizer step, however many micro-batches
    assert more.exposed_comm_seconds == pytest.approx(e.exposed_comm_seconds)


def test_slow_network_reads_communication_bound_and_overlap_helps():
    slow = estimate(JobSpec(**BASE, net_gbits=10))
    assert slow.efficiency < 0.70 and slow.reading.startswith("communication-bound")
    assert slow.largest_loss.startswith("exposed all-reduce")
    hidden = estimate(JobSpec(**BASE, net_gbits=10, overlap=0.9))
    assert hidden.exposed_comm_seconds == pytest.approx(0.1 * slow.exposed_comm_seconds)
    assert hidden.efficiency > slow.efficiency


def test_step_jitter_follows_the_slowest_of_all_gpus():
    e = estimate(JobSpec(**BASE, jitter_cv=0.02))
    assert e.jitter_seconds == pytest.approx(e.compute_seconds * 0.02 * expected_normal_max(128))


def test_failures_and_checkpoints_cost_time_async_less_than_sync():
    plain = estimate(JobSpec(**BASE))
    sync = estimate(JobSpec(**{**BASE, "t_provision": 300}, checkpoint_seconds=30, mtbf_hours=24))
    asyn = estimate(JobSpec(**{**BASE, "t_provision": 300}, checkpoint_seconds=30, checkpoint_mode="async",
                            mtbf_hours=24))
    assert plain.predicted_seconds < asyn.predicted_seconds < sync.predicted_seconds
    assert sync.checkpoint_interval_seconds == pytest.approx(ck.daly_interval(30, DAY))
    assert asyn.checkpoint_interval_seconds == pytest.approx(ck.daly_interval(3, DAY))
    assert sync.expected_failures == pytest.approx(sync.predicted_seconds / DAY)
    assert sync.restart_seconds == 300
    assert asyn.restart_seconds == 300 + 27  # the background write is at risk


def test_sync_wall_is_the_minimum_of_the_node_sweep():
    spec = JobSpec(**{**BASE, "net_latency_us": 50.0, "mtbf_hours": 24.0, "t_provision": 600.0,
                      "checkpoint_seconds": 60.0})
    wall = estimate(spec).sync_wall
    assert wall["reached"] and wall["limited_by"] == "minimum"
    curve = {p["nodes"]: p["predicted_seconds"] for p in wall["curve"]}
    assert min(curve, key=curve.get) == wall["nodes"]
    larger = [n for n in curve if n > wall["nodes"]]
    assert larger and all(curve[n] > wall["predicted_seconds"] for n in larger)
    # a faster network moves the wall out
    faster = estimate(JobSpec(**{**BASE, "net_latency_us": 5.0, "mtbf_hours": 24.0, "t_provision": 600.0,
                                 "checkpoint_seconds": 60.0})).sync_wall
    assert faster["nodes"] > wall["nodes"]


def test_the_sync_wall_sweep_fails_more_often_on_more_nodes():
    """Node failures are independent: the cluster's MTBF falls as 1/nodes. The sweep estimates 32
    nodes of a job measured at 24 h on 16 with an MTBF of 12 h, and 8 nodes with 48 h."""
    spec = JobSpec(**{**BASE, "t_provision": 600.0}, checkpoint_seconds=60.0, mtbf_hours=24.0)
    curve = {p["nodes"]: p["predicted_seconds"] for p in estimate(spec).sync_wall["curve"]}
    for nodes, hours in ((32, 12.0), (8, 48.0)):
        there = JobSpec(**{**BASE, "t_provision": 600.0, "nodes": nodes}, checkpoint_seconds=60.0,
                        mtbf_hours=hours)
        alone = estimate(there, with_sync_wall=False)
        assert curve[nodes] == pytest.approx(alone.predicted_seconds, rel=1e-12)


def test_a_restart_costs_its_catch_up_too():
    """R is drain + provision + download + reinit + catch-up: a fixed catch-up of 90 s beyond the
    re-run steps is part of every restart, and of the expected wall time."""
    spec = dict(**BASE, checkpoint_seconds=30.0, mtbf_hours=24.0)
    without, catching_up = estimate(JobSpec(**spec)), estimate(JobSpec(**spec, t_catchup=90.0))
    assert (without.restart_seconds, catching_up.restart_seconds) == (0, 90)
    assert catching_up.failure_overhead_seconds > without.failure_overhead_seconds
    assert catching_up.predicted_seconds == pytest.approx(ck.daly_wall_seconds(
        catching_up.solve_seconds, catching_up.checkpoint_interval_seconds, 30.0, 90.0, DAY))


def test_sync_wall_stops_where_the_global_batch_cannot_split_further():
    e = estimate(JobSpec(**BASE, seq_len=4096, microbatches=8))
    # 4 Mi tokens / 4096 = 1024 samples / 8 micro-batches = 128 replicas = 16 nodes of 8
    assert e.sync_wall["curve"][-1]["nodes"] == 16
    assert not e.sync_wall["reached"] and e.sync_wall["limited_by"] == "global batch"


def test_a_node_count_the_global_batch_cannot_split_over_is_refused(monkeypatch, capsys):
    """4 M tokens of 4096-token samples in 16 micro-batches hold 61 replicas of TP 8 x PP 4: at most
    244 nodes. 512 nodes were priced (8 days) as if each of 128 replicas had its share of the
    batch, and the same summary said the batch limited the job to 244 nodes."""
    argv = ["jct", "--params", "70G", "--tokens", "2T", "--batch-tokens", "4M", "--seq-len", "4096",
            "--sustained-tflops", "400", "--tp", "8", "--pp", "4", "--microbatches", "16",
            "--checkpoint-seconds", "30", "--mtbf-hours", "24"]
    code, out, err = run_cli(monkeypatch, capsys, [*argv, "--nodes", "512"])
    assert code == 2 and out == ""
    assert err == ("syncwatch jct: error: --nodes 512 makes 128 data-parallel replicas (TP 8 x PP 4), but the "
                   "global batch splits into at most 61 (--batch-tokens 4e+06 / --seq-len 4096 / --microbatches "
                   "16: a micro-batch holds at least one sample): at most 244 nodes\n")
    code, _, err = run_cli(monkeypatch, capsys, [*argv, "--nodes", "248"])  # 62 replicas
    assert code == 2 and "at most 244 nodes" in err
    est = run_json(monkeypatch, capsys, [*argv, "--nodes", "244"])["estimate"]
    assert est["dp"] == 61 and est["sync_wall"]["curve"][-1]["nodes"] == 244


# ---- the command line

def test_config_file_flags_and_environment_precedence(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("params: 7G\ntokens: 1T\nbatch-tokens: 4M\nnodes: 16\nsustained_tflops: 400\n")
    base = run_json(monkeypatch, capsys, ["jct", "--config", str(cfg)])
    assert base["spec"]["nodes"] == 16 and base["spec"]["params"] == 7e9
    flag = run_json(monkeypatch, capsys, ["jct", "--config", str(cfg), "--nodes", "32"])
    assert flag["spec"]["nodes"] == 32
    monkeypatch.setenv("SYNCWATCH_NODES", "8")
    env = run_json(monkeypatch, capsys, ["jct", "--config", str(cfg)])
    assert env["spec"]["nodes"] == 8
    assert env["estimate"]["predicted_seconds"] == pytest.approx(2 * base["estimate"]["predicted_seconds"], rel=0.05)


def test_summary_names_the_figures(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, [
        "jct", "--params", "70G", "--tokens", "2T", "--batch-tokens", "4M", "--nodes", "128",
        "--sustained-tflops", "400", "--tp", "8", "--pp", "4", "--microbatches", "16",
        "--checkpoint-seconds", "30", "--mtbf-hours", "24"])
    assert code == 0
    for words in ("theoretical minimum", "predicted wall-clock", "utilization efficiency",
                  "TP 8 x PP 4 x DP 32", "checkpoints", "Young 37m 57s", "failures", "sync wall"):
        assert words in out


def test_counts_of_one_are_singular(monkeypatch, capsys):
    """One GPU on one node for one step read "1 GPUs (1 nodes x 1)", "x 1 GPUs" and "(1 steps)";
    a node count the batch cannot split over "makes 1 data-parallel replicas"."""
    argv = ["jct", "--params", "1G", "--tokens", "1M", "--seq-len", "1024", "--nodes", "1",
            "--gpus-per-node", "1", "--sustained-tflops", "100"]
    code, out, err = run_cli(monkeypatch, capsys, [*argv, "--batch-tokens", "1M"])
    assert code == 0, err
    assert out.startswith("syncwatch jct: 1 GPU (1 node x 1), TP 1 x PP 1 x DP 1,")
    assert "TFLOPS x 1 GPU)" in out and "  per step (1 step) compute" in out
    code, _, err = run_cli(monkeypatch, capsys, [*argv, "--batch-tokens", "100"])
    assert code == 2 and "--nodes 1 makes 1 data-parallel replica (TP 1 x PP 1)" in err


def test_failures_without_a_checkpoint_cost_say_checkpoints_are_assumed_free(monkeypatch, capsys):
    """With --mtbf-hours and the default --checkpoint-seconds 0 the model checkpoints continuously
    at no cost (a failure loses its restart only), yet the summary said "checkpoints none
    modelled", as if each failure re-ran its work since some checkpoint."""
    argv = ["jct", "--params", "70G", "--tokens", "2T", "--batch-tokens", "4M", "--nodes", "128",
            "--sustained-tflops", "400", "--tp", "8", "--pp", "4", "--microbatches", "16"]
    code, out, _ = run_cli(monkeypatch, capsys, [*argv, "--mtbf-hours", "24"])
    assert code == 0
    assert ("  checkpoints             assumed free and continuous (a stall of 0 s each): a failure re-runs "
            "no work; give --checkpoint-seconds for what one costs\n") in out
    assert "none modelled" not in out and "with re-runs" not in out
    est = run_json(monkeypatch, capsys, [*argv, "--mtbf-hours", "24"])["estimate"]
    assert est["checkpoint_model"] == "free" and est["checkpoint_interval_seconds"] is None
    assert est["failure_overhead_seconds"] == pytest.approx(est["expected_failures"] * est["restart_seconds"],
                                                            rel=0.01)
    code, out, _ = run_cli(monkeypatch, capsys, argv)  # no failures: no checkpoints either
    assert "checkpoints             none modelled" in out
    assert run_json(monkeypatch, capsys, argv)["estimate"]["checkpoint_model"] == "none"
    est = run_json(monkeypatch, capsys, [*argv, "--mtbf-hours", "24", "--checkpoint-seconds", "30"])["estimate"]
    assert est["checkpoint_model"] == "interval" and est["checkpoint_interval_seconds"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "4"], "--sustained-tflops is required"),
    (["--nodes", "4", "--sustained-tflops", "100"], "give the work"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20"], "give the optimizer steps"),
    (["--nodes", "3", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10", "--tp", "8",
      "--pp", "1", "--gpus-per-node", "8", "--grad-bytes", "1G", "--tp", "3"], "must divide"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--overlap", "2"], "--overlap"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--checkpoint-interval", "often"], "--checkpoint-interval"),
    # non-finite numbers were taken: NaN jitter printed "predicted never", infinities nonsense
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--jitter-cv", "nan"], "--jitter-cv must be a finite number (got nan)"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1e999"], "--grad-bytes must be a finite number (got inf)"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--t-drain", "inf"], "--t-drain must be a finite number"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--checkpoint-interval", "inf"], "--checkpoint-interval must be a positive number"),
    (["--nodes", "4", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--params", "1G", "--grad-dtype-bytes", "0"], "--grad-dtype-bytes must be positive"),
    # the sweep ran to 4 nodes only: "sync wall not reached up to 4 nodes", with the time predicted
    # there, longer than the job's own on its 16; a negative count swept 1 node
    (["--nodes", "16", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--max-nodes", "4"], "--max-nodes 4 is below --nodes 16"),
    (["--nodes", "16", "--sustained-tflops", "100", "--flops", "1e20", "--steps", "10",
      "--grad-bytes", "1G", "--max-nodes", "-3"], "--max-nodes -3 is below --nodes 16"),
])
def test_bad_input_exits_2_with_a_clear_message(monkeypatch, capsys, argv, message):
    code, out, err = run_cli(monkeypatch, capsys, ["jct", *argv])
    assert code == 2 and out == ""
    assert message in err and err.startswith("syncwatch jct: error:")


def test_bad_config_file_exits_2(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 4\nwarp_drive: 9\n")
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])
    assert code == 2 and "unknown key 'warp_drive'" in err
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(tmp_path / "missing.yaml")])
    assert code == 2 and "cannot read --config" in err
    bad.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe")  # a binary: a UnicodeDecodeError traceback
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])
    assert code == 2 and "is not a text file" in err and "Traceback" not in err
    # a YAML error printed its own five lines: the line at fault, a caret, the parser's context
    bad.write_text("nodes: [1\n")
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"syncwatch jct: error: --config {bad} is not valid YAML/JSON: expected ',' or ']'")
    assert err.endswith("(line 2, column 1)\n"), err
    bad.write_text("nodes: 4\x00\n")
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])
    assert code == 2 and err.count("\n") == 1 and "special characters are not allowed" in err, err
    # a count as a fraction or a boolean was truncated (128.5 nodes -> 128, true -> 1)
    for text, message in (("nodes: 128.5\n", "nodes: 128.5 is not an integer"),
                          ("nodes: true\n", "nodes: True is not an integer")):
        bad.write_text(text + "sustained_tflops: 400\n")
        code, _, err = run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])
        assert code == 2 and message in err, err
    bad.write_text("nodes: 1.28e+2\nsustained_tflops: 400\nparams: 70e9\ntokens: 2e12\n"
                   "batch_tokens: 4e6\nseq_len: 2048\n")
    assert run_cli(monkeypatch, capsys, ["jct", "--config", str(bad)])[0] == 0


_JOB = {"--params": "70G", "--tokens": "2T", "--batch-tokens": "4M", "--seq-len": "4096", "--nodes": "64",
        "--sustained-tflops": "400"}
_REFUSAL = ("{} 512 makes 4096 data-parallel replicas (TP 1 x PP 1), but the global batch splits into at "
            "most 976 (--batch-tokens 4e+06 / --seq-len 4096 / --microbatches 1: a micro-batch holds at "
            "least one sample): at most 122 nodes")


def _job_with(tmp_path, monkeypatch, source: str, flag: str, value: str) -> tuple[list[str], str]:
    """``_JOB``'s flags with ``flag`` ``value`` given by ``source`` (flag, env or config), and the
    name its errors must give it."""
    argv = ["jct", *(a for f, v in _JOB.items() if f != flag for a in (f, v))]
    if source == "flag":
        return [*argv, flag, value], flag
    if source == "env":
        monkeypatch.setenv(cli.env_name(flag), value)
        return argv, f"{flag} (from {cli.env_name(flag)})"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"{flag[2:]}: {value}\n")
    return [*argv, "--config", str(cfg)], f"{flag} (from {flag[2:]} in {cfg})"


@pytest.mark.parametrize("source", ["flag", "env", "config"])
@pytest.mark.parametrize("flag, value, message", [
    ("--jitter-cv", "-1", "{} must not be negative"),
    ("--nodes", "0", "{} must be positive (got 0)"),
    ("--grad-dtype-bytes", "0", "{} must be positive (got 0.0)"),
    ("--tokens", "0", "{} must be positive (got 0.0)"),
    ("--t-drain", "inf", "{} must be a finite number (got inf)"),
    ("--overlap", "2", "{} is a fraction between 0 and 1"),
    ("--checkpoint-interval", "often", "{} must be daly, young or seconds (got 'often')"),
    ("--checkpoint-interval", "-5", "{} must be a positive number of seconds (got '-5')"),
    ("--checkpoint-stall", "5", "{} must lie between 0 and --checkpoint-seconds"),
    ("--checkpoint-mode", "later", "{} must be sync or async"),
    ("--algorithm", "mesh", "{} must be one of ring, tree"),
    ("--max-nodes", "4", "{} 4 is below --nodes 64 (the sync-wall sweep compares the job's node count "
                         "with the others up to it)"),
    ("--tp", "3", "{} 3 must divide --gpus-per-node 8 (tensor parallelism stays inside a node)"),
    ("--pp", "3", "512 GPUs (--nodes 64 x --gpus-per-node 8) do not split into --tp 1 x {} 3 groups"),
    ("--nodes", "512", _REFUSAL),
    ("--seq-len", "65536", "--nodes 64 makes 512 data-parallel replicas (TP 1 x PP 1), but the global batch "
                           "splits into at most 61 (--batch-tokens 4e+06 / {} 65536 / --microbatches 1: a "
                           "micro-batch holds at least one sample): at most 7 nodes"),
])
def test_a_value_error_names_where_the_value_came_from(tmp_path, monkeypatch, capsys, source, flag, value,
                                                        message):
    """Every error named the flag: "--jitter-cv must not be negative" for SYNCWATCH_JITTER_CV=-1 or
    ``jitter-cv: -1`` in the --config file, a flag the user never typed. It names the flag's
    environment twin or the config file's key, as the daemon's errors name a twin."""
    argv, name = _job_with(tmp_path, monkeypatch, source, flag, value)
    code, out, err = run_cli(monkeypatch, capsys, argv)
    assert code == 2 and out == ""
    assert err == f"syncwatch jct: error: {message.format(name)}\n"


def test_each_value_of_an_error_is_named_by_its_own_source(tmp_path, monkeypatch, capsys):
    """The refusal of a node count the batch cannot split over names three values: each by where it
    came from, a key as the config file spells it."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("batch_tokens: 4M\n")
    monkeypatch.setenv("SYNCWATCH_NODES", "512")
    code, _, err = run_cli(monkeypatch, capsys, ["jct", "--params", "70G", "--tokens", "2T", "--seq-len", "4096",
                                                 "--sustained-tflops", "400", "--config", str(cfg)])
    assert code == 2
    assert err == ("syncwatch jct: error: --nodes (from SYNCWATCH_NODES) 512 makes 4096 data-parallel replicas "
                   f"(TP 1 x PP 1), but the global batch splits into at most 976 (--batch-tokens (from "
                   f"batch_tokens in {cfg}) 4e+06 / --seq-len 4096 / --microbatches 1: a micro-batch holds "
                   "at least one sample): at most 122 nodes\n")


def test_an_unreadable_config_file_names_its_twin(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "missing.yaml"
    monkeypatch.setenv("SYNCWATCH_CONFIG", str(missing))
    code, _, err = run_cli(monkeypatch, capsys, ["jct"])
    assert code == 2
    assert err == (f"syncwatch jct: error: cannot read --config (from SYNCWATCH_CONFIG) {missing}: No such file "
                   "or directory\n")
    missing.write_text("- 1\n")
    code, _, err = run_cli(monkeypatch, capsys, ["jct"])
    assert err == (f"syncwatch jct: error: --config (from SYNCWATCH_CONFIG) {missing} must hold a mapping of "
                   "flag names to values\n")


def test_a_null_in_the_config_file_leaves_its_flag_at_the_default(tmp_path, monkeypatch, capsys):
    """``jitter-cv: null`` ended in a traceback (a TypeError: None compared with 0), as did a null
    --checkpoint-interval or --grad-dtype-bytes; null reads as the key left out, as it did for
    the flags whose default is derived (--flops, --max-nodes)."""
    argv = ["jct", *(a for f, v in _JOB.items() for a in (f, v))]
    cfg = tmp_path / "job.yaml"
    cfg.write_text("jitter-cv: null\ncheckpoint-interval: null\ngrad_dtype_bytes: null\nmax-nodes: null\n"
                   "tp: null\n")
    assert run_json(monkeypatch, capsys, [*argv, "--config", str(cfg)]) == run_json(monkeypatch, capsys, argv)


@pytest.mark.parametrize("source, message", [
    ("flag", "argument --params: invalid quantity value: '70Q'"),
    ("env", "SYNCWATCH_PARAMS='70Q': not a number: '70Q' (examples: 70e9, 70G, 1.5T)"),
    ("config", "{cfg}: params: not a number: '70Q' (examples: 70e9, 70G, 1.5T)"),
])
def test_an_unparseable_size_names_where_it_came_from(tmp_path, monkeypatch, capsys, source, message):
    """The parser refuses a flag's or a twin's value, naming it; the config file's is refused once
    read, naming the file and the key."""
    argv, _ = _job_with(tmp_path, monkeypatch, source, "--params", "70Q")
    if source == "config":
        code, out, err = run_cli(monkeypatch, capsys, argv)
    else:
        with pytest.raises(SystemExit) as e:
            run_cli(monkeypatch, capsys, argv)
        code, (out, err) = e.value.code, capsys.readouterr()
    assert code == 2 and out == ""
    assert err.endswith(f"syncwatch jct: error: {message.format(cfg=tmp_path / 'job.yaml')}\n"), err


def test_a_job_failing_faster_than_it_recovers_cannot_finish(monkeypatch, capsys):
    """A failure every 3.6 s against a 10 min restart printed a predicted wall-clock of an
    80-digit number of days, and as many expected failures."""
    argv = ["jct", "--params", "70G", "--tokens", "2T", "--batch-tokens", "4M", "--seq-len", "2048",
            "--nodes", "128", "--sustained-tflops", "400", "--checkpoint-seconds", "30"]
    code, out, _ = run_cli(monkeypatch, capsys, [*argv, "--mtbf-hours", "0.001"])
    assert code == 0
    assert ("predicted wall-clock    never: the job cannot be expected to finish (a failure every 3.60 s "
            "against a restart of 10m 0s; without failures 30d 22h 5m)") in out
    assert "failures strike faster than the job recovers" in out
    assert max(len(run) for run in re.findall(r"\d+", out)) <= 6, out
    est = run_json(monkeypatch, capsys, [*argv, "--mtbf-hours", "0.001"])["estimate"]
    assert est["finishes"] is False and est["reading"].startswith("the job cannot finish")
    # a ten-thousandth of that: failures 36 ms apart, Daly's formula overflows; no node count helps
    code, out, _ = run_cli(monkeypatch, capsys, [*argv, "--mtbf-hours", "0.00001", "--max-nodes", "200"])
    assert code == 0 and "never: the job cannot be expected to finish" in out
    assert "sync wall               none: the job cannot be expected to finish at any node count up to 200" in out
    # slow but finishing: figures as before
    est = run_json(monkeypatch, capsys, [*argv, "--mtbf-hours", "0.2"])["estimate"]
    assert est["finishes"] is True and est["predicted_seconds"] == pytest.approx(3.12 * est["solve_seconds"], rel=0.01)


def test_a_job_without_data_parallelism_needs_no_gradient_size(monkeypatch, capsys):
    """One GPU (or TP x PP filling the GPUs: one replica) all-reduces no gradient, and validate()
    asks for no gradient size there, but the sync-wall sweep's larger node counts did: the whole
    estimate was refused with "give --grad-bytes ... or --params". It is now made, and the sync
    wall says what it needs."""
    for layout in (["--nodes", "1", "--gpus-per-node", "1"],
                   ["--nodes", "2", "--gpus-per-node", "4", "--tp", "4", "--pp", "2"]):
        argv = ["jct", *layout, "--sustained-tflops", "100", "--flops", "1e18", "--steps", "10"]
        code, out, err = run_cli(monkeypatch, capsys, argv)
        assert code == 0, err
        assert ("  sync wall               not computed: more nodes all-reduce the gradient; give "
                "--grad-bytes or --params\n") in out
        est = run_json(monkeypatch, capsys, argv)["estimate"]
        assert est["sync_wall"] == {} and est["finishes"] and est["predicted_seconds"] > 0
