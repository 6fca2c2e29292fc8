"""``syncwatch jct``: job-completion-time estimate of a synchronous training job.

Model (docs/analysis.md has the derivation and worked figures):

* compute per step = FLOPs per step / (GPUs x sustained TFLOPS)
* pipeline bubble  = compute x (PP - 1) / M, M = micro-batches per optimizer step (= gradient
  accumulation steps: the gradient all-reduce runs once per M micro-batches)
* straggler jitter = compute x CV x E[max of G standard normals] (the step waits for the slowest GPU)
* all-reduce       = two-tier Hockney model (``collectives``), minus the overlapped fraction
* checkpoints and failures: Daly's expected wall time (``checkpoint``), restart cost
  R = T_drain + T_provision + T_download + T_reinit + T_catchup; the re-run of steps lost since the
  last checkpoint is part of Daly's formula
* theoretical minimum = total FLOPs / (GPUs x sustained TFLOPS); utilization efficiency =
  minimum / predicted; sync wall = node count minimizing predicted wall time at the same global batch
* a job whose predicted wall time exceeds ``NEVER_FACTOR`` x its failure-free time (failures faster
  than it recovers and checkpoints) cannot be expected to finish, and is reported so
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import yaml

from .. import cli
from . import checkpoint as ck
from .collectives import ALGORITHMS, hierarchical_allreduce_seconds
from .common import AnalysisError, command, emit_json, finite_or_none, human_seconds, pct, plural, quantity, tracked
from .orderstats import expected_normal_max

COMM_BOUND, COMPUTE_BOUND = 0.70, 0.85
NEVER_FACTOR = 100.0  # predicted / failure-free time beyond which more than 99 % of the time is lost
MAX_SWEEP_NODES = 1 << 17


@dataclass(frozen=True)
class JobSpec:
    """Everything the estimate needs; ``None`` = derive from the other fields."""

    nodes: int
    sustained_tflops: float
    gpus_per_node: int = 8
    flops: float | None = None
    params: float | None = None
    tokens: float | None = None
    flops_per_token: float | None = None
    steps: float | None = None
    batch_tokens: float | None = None
    seq_len: float | None = None
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    grad_bytes: float | None = None
    grad_dtype_bytes: float = 2.0
    algorithm: str = "ring"
    nvlink_gbytes: float = 450.0
    nvlink_latency_us: float = 2.0
    net_gbits: float = 400.0
    net_latency_us: float = 10.0
    overlap: float = 0.0
    jitter_cv: float = 0.0
    checkpoint_seconds: float = 0.0
    checkpoint_mode: str = "sync"
    checkpoint_stall: float | None = None
    checkpoint_interval: str = "daly"
    mtbf_hours: float | None = None
    t_drain: float = 60.0
    t_provision: float = 300.0
    t_download: float = 120.0
    t_reinit: float = 120.0
    t_catchup: float = 0.0
    max_nodes: int | None = None

    # ---- derived quantities, validated ----
    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def total_flops(self) -> float:
        if self.flops is not None:
            return self.flops
        if self.tokens is None or (self.params is None and self.flops_per_token is None):
            raise AnalysisError("give the work: --flops, or --tokens with --params (or --flops-per-token)")
        per_token = self.flops_per_token if self.flops_per_token is not None else 6 * self.params
        return per_token * self.tokens

    def total_steps(self) -> float:
        if self.steps is not None:
            return self.steps
        if self.tokens is not None and self.batch_tokens:
            return self.tokens / self.batch_tokens
        raise AnalysisError("give the optimizer steps: --steps, or --tokens with --batch-tokens")

    def gradient_bytes(self) -> float:
        if self.grad_bytes is not None:
            return self.grad_bytes
        if self.params is None:
            raise AnalysisError("give --grad-bytes (gradient bytes per GPU per step) or --params")
        return self.params / (self.tp * self.pp) * self.grad_dtype_bytes

    def validate(self, name: Callable[[str], str] = lambda flag: flag) -> None:
        """Refuse values the estimate cannot take. ``name``: a flag as an error about its value
        names it; ``spec_from_args`` gives the one naming where the value came from (``--nodes
        (from SYNCWATCH_NODES)``, ``--nodes (from nodes in job.yaml)``)."""
        def flag(dest: str) -> str:
            return name(_flag(dest))

        for dest in ("nodes", "gpus_per_node", "sustained_tflops", "tp", "pp", "microbatches",
                     "nvlink_gbytes", "net_gbits"):
            v = getattr(self, dest)
            if v is None or not v > 0:
                raise AnalysisError(f"{flag(dest)} must be positive (got {v})")
        for dest in ("flops", "params", "tokens", "flops_per_token", "steps", "batch_tokens",
                     "seq_len", "grad_bytes", "mtbf_hours"):
            v = getattr(self, dest)
            if v is not None and not v > 0:
                raise AnalysisError(f"{flag(dest)} must be positive (got {v})")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise AnalysisError(f"{flag(f.name)} must be a finite number (got {v})")
        if not self.grad_dtype_bytes > 0:
            raise AnalysisError(f"{flag('grad_dtype_bytes')} must be positive (got {self.grad_dtype_bytes})")
        for dest in ("checkpoint_seconds", "t_drain", "t_provision", "t_download", "t_reinit",
                     "t_catchup", "jitter_cv", "nvlink_latency_us", "net_latency_us"):
            if getattr(self, dest) < 0:
                raise AnalysisError(f"{flag(dest)} must not be negative")
        if self.max_nodes is not None and self.max_nodes < self.nodes:
            raise AnalysisError(f"{flag('max_nodes')} {self.max_nodes} is below {flag('nodes')} {self.nodes} "
                                "(the sync-wall sweep compares the job's node count with the others up to it)")
        if not 0 <= self.overlap <= 1:
            raise AnalysisError(f"{flag('overlap')} is a fraction between 0 and 1")
        if self.gpus_per_node % self.tp:
            raise AnalysisError(f"{flag('tp')} {self.tp} must divide {flag('gpus_per_node')} {self.gpus_per_node} "
                                "(tensor parallelism stays inside a node)")
        if self.gpus % (self.tp * self.pp):
            raise AnalysisError(f"{self.gpus} GPUs ({flag('nodes')} {self.nodes} x {flag('gpus_per_node')} "
                                f"{self.gpus_per_node}) do not split into {flag('tp')} {self.tp} x {flag('pp')} "
                                f"{self.pp} groups")
        if self.algorithm not in ALGORITHMS:
            raise AnalysisError(f"{flag('algorithm')} must be one of {', '.join(ALGORITHMS)}")
        if self.checkpoint_mode not in ("sync", "async"):
            raise AnalysisError(f"{flag('checkpoint_mode')} must be sync or async")
        if self.checkpoint_stall is not None and not 0 <= self.checkpoint_stall <= self.checkpoint_seconds:
            raise AnalysisError(f"{flag('checkpoint_stall')} must lie between 0 and {flag('checkpoint_seconds')}")
        interval_seconds(self.checkpoint_interval, flag("checkpoint_interval"))
        most, dp = self.max_replicas(), self.gpus // (self.tp * self.pp)
        if most is not None and dp > most:
            nodes = int(most * self.tp * self.pp // self.gpus_per_node)
            raise AnalysisError(
                f"{flag('nodes')} {self.nodes} makes {plural(dp, 'data-parallel replica')} (TP {self.tp} x PP "
                f"{self.pp}), but the global batch splits into at most {math.floor(most)} "
                f"({flag('batch_tokens')} {self.batch_tokens:g} / {flag('seq_len')} {self.seq_len:g} / "
                f"{flag('microbatches')} {self.microbatches}: a micro-batch holds at least one sample): "
                f"at most {plural(nodes, 'node')}")
        self.total_flops(), self.total_steps()
        if self.gpus > self.tp * self.pp:
            self.gradient_bytes()

    def max_replicas(self) -> float | None:
        """The most data-parallel replicas the global batch splits into (a micro-batch holds at
        least one sample): batch tokens / seq-len / micro-batches; None without both sizes."""
        if self.batch_tokens and self.seq_len:
            return self.batch_tokens / self.seq_len / self.microbatches
        return None

    def stall_seconds(self) -> float:
        """Training time lost per checkpoint: the whole write (sync), or the snapshot (async)."""
        if self.checkpoint_mode == "sync":
            return self.checkpoint_seconds
        if self.checkpoint_stall is not None:
            return self.checkpoint_stall
        return self.checkpoint_seconds / 10  # device-to-host snapshot: ~an order below the write

    def restart_seconds(self) -> float:
        """R: drain + provision + download + reinit + catch-up, and for asynchronous checkpoints the
        background write, since a failure before it completes falls back to the previous one."""
        r = self.t_drain + self.t_provision + self.t_download + self.t_reinit + self.t_catchup
        if self.checkpoint_mode == "async":
            r += self.checkpoint_seconds - self.stall_seconds()
        return r


def interval_seconds(text: str, flag: str = "--checkpoint-interval") -> float | None:
    """``daly`` / ``young`` -> None (optimum), else a fixed interval in seconds; errors name the
    value ``flag``."""
    if str(text).lower() in ("daly", "young"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise AnalysisError(f"{flag} must be daly, young or seconds (got {text!r})") from None
    if not (math.isfinite(v) and v > 0):
        raise AnalysisError(f"{flag} must be a positive number of seconds (got {text!r})")
    return v


@dataclass
class Estimate:
    nodes: int
    gpus: int
    dp: int
    dp_local: int
    dp_nodes: int
    steps: float
    total_flops: float
    theoretical_min_seconds: float
    compute_seconds: float
    bubble_seconds: float
    jitter_seconds: float
    allreduce_intra_seconds: float
    allreduce_inter_seconds: float
    exposed_comm_seconds: float
    step_seconds: float
    solve_seconds: float
    checkpoint_stall_seconds: float
    checkpoint_interval_seconds: float | None
    young_interval_seconds: float | None
    daly_interval_seconds: float | None
    checkpoint_overhead_seconds: float
    checkpoint_model: str            # "interval": one every checkpoint_interval_seconds; "free":
    #                                  continuous, at no cost (a stall of 0 with failures); "none"
    mtbf_seconds: float | None
    restart_seconds: float
    expected_failures: float
    failure_overhead_seconds: float
    predicted_seconds: float
    finishes: bool                   # False: failures outpace recovery (predicted > NEVER_FACTOR x solve)
    efficiency: float
    reading: str
    largest_loss: str
    sync_wall: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: (finite_or_none(v) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def reading(efficiency: float) -> str:
    if efficiency < COMM_BOUND:
        return "communication-bound (below 70 %)"
    if efficiency > COMPUTE_BOUND:
        return "compute-bound (above 85 %)"
    return "balanced (70-85 %)"


def estimate(spec: JobSpec, *, with_sync_wall: bool = True,
             name: Callable[[str], str] = lambda flag: flag) -> Estimate:
    """``name``: as ``JobSpec.validate``'s."""
    spec.validate(name)
    gpus = spec.gpus
    flops, steps = spec.total_flops(), spec.total_steps()
    rate = gpus * spec.sustained_tflops * 1e12
    t_min = flops / rate

    compute = flops / steps / rate
    bubble = compute * (spec.pp - 1) / spec.microbatches
    jitter = compute * spec.jitter_cv * expected_normal_max(gpus) if spec.jitter_cv else 0.0

    dp = gpus // (spec.tp * spec.pp)
    dp_local = min(dp, spec.gpus_per_node // spec.tp)
    dp_nodes = math.ceil(dp / dp_local)
    if dp > 1:
        intra, inter = hierarchical_allreduce_seconds(
            spec.gradient_bytes(), dp_local, dp_nodes,
            intra_bandwidth=spec.nvlink_gbytes * 1e9, intra_latency=spec.nvlink_latency_us * 1e-6,
            inter_bandwidth=spec.net_gbits * 1e9 / 8, inter_latency=spec.net_latency_us * 1e-6,
            algorithm=spec.algorithm)
    else:
        intra = inter = 0.0
    exposed = (intra + inter) * (1 - spec.overlap)
    step = compute + bubble + jitter + exposed
    solve = steps * step

    stall = spec.stall_seconds()
    mtbf = spec.mtbf_hours * 3600 if spec.mtbf_hours else None
    young = ck.young_interval(stall, mtbf) if mtbf and stall > 0 else None
    daly = ck.daly_interval(stall, mtbf) if mtbf and stall > 0 else None
    fixed = interval_seconds(spec.checkpoint_interval)
    if fixed is not None:
        interval = fixed
    elif stall > 0 and mtbf:
        interval = young if spec.checkpoint_interval.lower() == "young" else daly
    else:
        interval = None  # free checkpoints (a stall of 0, failures modelled), or none
    # with failures and a checkpoint that stalls nothing, checkpoints are taken continuously: a
    # failure re-runs no work and costs its restart only. The default --checkpoint-seconds 0 gets
    # this, and the output says so ("none modelled" read as if failures re-ran their work)
    model = "interval" if interval is not None else "free" if mtbf else "none"
    restart = spec.restart_seconds()
    tau = interval if interval is not None else math.inf
    ckpt_overhead = solve * stall / tau if math.isfinite(tau) else 0.0
    if mtbf and not math.isfinite(tau):
        tau = 1e-9 * mtbf  # checkpoint continuously at no cost: only the restarts remain
    predicted = ck.daly_wall_seconds(solve, tau, stall if math.isfinite(tau) else 0.0, restart, mtbf)
    fail_overhead = predicted - solve - ckpt_overhead
    failures = predicted / mtbf if mtbf else 0.0
    eff = t_min / predicted if predicted > 0 else 0.0
    finishes = predicted <= NEVER_FACTOR * solve

    losses = {"pipeline bubble": steps * bubble, "straggler jitter": steps * jitter,
              "exposed all-reduce": steps * exposed, "checkpoints": ckpt_overhead,
              "failures and re-runs": fail_overhead}
    name, lost = max(losses.items(), key=lambda kv: kv[1])
    share = f" ({pct(lost / predicted)} of wall time)" if math.isfinite(predicted) else ""
    largest = f"{name}{share}" if lost > 0 and predicted > 0 else "none"

    est = Estimate(
        nodes=spec.nodes, gpus=gpus, dp=dp, dp_local=dp_local, dp_nodes=dp_nodes, steps=steps,
        total_flops=flops, theoretical_min_seconds=t_min, compute_seconds=compute,
        bubble_seconds=bubble, jitter_seconds=jitter, allreduce_intra_seconds=intra,
        allreduce_inter_seconds=inter, exposed_comm_seconds=exposed, step_seconds=step,
        solve_seconds=solve, checkpoint_stall_seconds=stall, checkpoint_interval_seconds=interval,
        young_interval_seconds=young, daly_interval_seconds=daly,
        checkpoint_overhead_seconds=ckpt_overhead, checkpoint_model=model, mtbf_seconds=mtbf,
        restart_seconds=restart,
        expected_failures=failures, failure_overhead_seconds=fail_overhead,
        predicted_seconds=predicted, finishes=finishes, efficiency=eff,
        reading=reading(eff) if finishes else "the job cannot finish (failures outpace recovery)",
        largest_loss=largest)
    # without a gradient size (allowed where the job has one replica: no all-reduce) the sweep's
    # larger node counts cannot be estimated: no sync wall ({}), and the summary says what it needs
    if with_sync_wall and (spec.grad_bytes is not None or spec.params is not None):
        est.sync_wall = sync_wall(spec)
    return est


def node_limit(spec: JobSpec) -> tuple[int, str]:
    """Largest node count the sweep may try, and why: the global batch splits into at most
    ``samples per step / micro-batches`` data-parallel replicas (a micro-batch holds at least one
    sample), else the sweep's range."""
    limit, why = spec.max_nodes or MAX_SWEEP_NODES, "range"
    max_dp = spec.max_replicas()
    if max_dp is not None:
        batch_nodes = int(max_dp * spec.tp * spec.pp // spec.gpus_per_node)
        if batch_nodes < limit:
            limit, why = max(batch_nodes, 1), "global batch"
    return max(limit, 1), why


def sweep_nodes(spec: JobSpec, limit: int) -> list[int]:
    """Valid node counts from 1 to ``limit`` on a geometric grid (16 per doubling), plus the current.

    A node count is valid when its GPUs split into whole TP x PP groups."""
    unit = (spec.tp * spec.pp) // math.gcd(spec.gpus_per_node, spec.tp * spec.pp)
    counts = {spec.nodes} if spec.nodes <= limit else set()
    top = max(unit, limit // unit * unit)
    counts.add(top)
    x = 1.0
    while x < top:
        counts.add(min(top, max(unit, int(round(x / unit)) * unit)))
        x *= 2 ** (1 / 16)
    return sorted(counts)


def at_nodes(spec: JobSpec, nodes: int) -> JobSpec:
    """The same job (same global batch, same work) on ``nodes`` nodes; node failures independent,
    so the cluster MTBF scales as 1/nodes."""
    mtbf = spec.mtbf_hours * spec.nodes / nodes if spec.mtbf_hours else None
    return replace(spec, nodes=nodes, mtbf_hours=mtbf)


def sync_wall(spec: JobSpec) -> dict:
    """The node count minimizing predicted wall time: beyond it adding nodes no longer shortens the job."""
    limit, why = node_limit(spec)
    curve = []
    for n in sweep_nodes(spec, limit):
        e = estimate(at_nodes(spec, n), with_sync_wall=False)
        curve.append((n, e.predicted_seconds, e.finishes))
    best_n, best_t, finishes = min(curve, key=lambda p: (p[1], p[0]))
    reached = best_n < curve[-1][0]
    return {
        "nodes": best_n,
        "predicted_seconds": finite_or_none(best_t),
        "finishes": finishes,
        "reached": reached,
        "limited_by": "minimum" if reached else why,
        "curve": [{"nodes": n, "predicted_seconds": finite_or_none(t)} for n, t, _ in curve],
    }


# ---------------------------------------------------------------- CLI

_FLAGS = [
    # flag, type, builtin default (None = derived or required), help
    ("--flops", quantity, None, "total training FLOPs (else 6 x params x tokens)"),
    ("--params", quantity, None, "model parameters, e.g. 70G or 70e9"),
    ("--tokens", quantity, None, "training tokens"),
    ("--flops-per-token", quantity, None, "FLOPs per token (default 6 x params)"),
    ("--steps", quantity, None, "optimizer steps (else tokens / batch tokens)"),
    ("--batch-tokens", quantity, None, "tokens per optimizer step (global batch)"),
    ("--seq-len", quantity, None, "tokens per sample; bounds data parallelism in the sync-wall sweep"),
    ("--nodes", int, None, "nodes"),
    ("--gpus-per-node", int, 8, "GPUs per node"),
    ("--sustained-tflops", float, None, "sustained (achieved, not peak) TFLOPS per GPU"),
    ("--tp", int, 1, "tensor-parallel degree (inside a node)"),
    ("--pp", int, 1, "pipeline-parallel stages"),
    ("--microbatches", int, 1, "micro-batches per optimizer step = gradient accumulation steps"),
    ("--grad-bytes", quantity, None, "gradient bytes per GPU per step (default params/(TP*PP) x dtype bytes)"),
    ("--grad-dtype-bytes", float, 2.0, "bytes per gradient element"),
    ("--algorithm", str, "ring", "inter-node all-reduce algorithm: ring or tree"),
    ("--nvlink-gbytes", float, 450.0, "intra-node (NVLink) bandwidth per GPU, GB/s"),
    ("--nvlink-latency-us", float, 2.0, "intra-node per-message latency, microseconds"),
    ("--net-gbits", float, 400.0, "network bandwidth per GPU, Gbit/s"),
    ("--net-latency-us", float, 10.0, "network per-message latency, microseconds"),
    ("--overlap", float, 0.0, "fraction of the all-reduce hidden behind backward compute (0..1)"),
    ("--jitter-cv", float, 0.0, "per-rank compute-time coefficient of variation (the step waits for the slowest)"),
    ("--checkpoint-seconds", float, 0.0, "T_ckpt: time to write one checkpoint"),
    ("--checkpoint-mode", str, "sync", "sync (training waits for the write) or async (only the snapshot stalls)"),
    ("--checkpoint-stall", float, None, "async: seconds training stalls per checkpoint (default T_ckpt/10)"),
    ("--checkpoint-interval", str, "daly", "daly, young, or a fixed interval in seconds"),
    ("--mtbf-hours", float, None, "cluster mean time between failures at this size, hours (none = no failures)"),
    ("--t-drain", float, 60.0, "recovery: drain the failed job, seconds"),
    ("--t-provision", float, 300.0, "recovery: provision a replacement node, seconds"),
    ("--t-download", float, 120.0, "recovery: download image and checkpoint, seconds"),
    ("--t-reinit", float, 120.0, "recovery: re-initialize (process groups, model, data), seconds"),
    ("--t-catchup", float, 0.0, "recovery: fixed catch-up beyond re-running lost steps, seconds"),
    ("--max-nodes", int, None, f"largest node count of the sync-wall sweep (default {MAX_SWEEP_NODES:,}, "
                               "or fewer where the global batch splits into fewer replicas)"),
]
_STORE = tracked(argparse._StoreAction)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "jct", help="job-completion-time estimate (compute, all-reduce, bubble, checkpoints, failures)",
        description="Estimate a training job's wall-clock time from a config file or flags. "
                    "Precedence: flag > SYNCWATCH_* environment > --config file > default.")
    cli.add_flag(p, "--config", help="YAML or JSON file whose keys are these flags' names", default=None)
    for flag, typ, default, text in _FLAGS:
        cli.add_flag(p, flag, type=typ, default=default, help=text, action=_STORE)
    cli.add_flag(p, "--json", action="store_true", help="print JSON instead of the summary")
    p.set_defaults(func=run)


def spec_from_args(args) -> tuple[JobSpec, Callable[[str], str]]:
    """Merge flags, environment twins and the config file into a ``JobSpec``; with it the function
    that names a flag in an error about its value (``JobSpec.validate``): ``--jitter-cv (from
    jitter_cv in job.yaml)`` where the config file gave the value (the key as the file spells it),
    else as ``cli.named`` does."""
    given = set(getattr(args, "_given", ()))
    given |= {_dest(f) for f, *_ in _FLAGS if cli.env_name(f) in os.environ}
    values = {_dest(f): getattr(args, _dest(f)) for f, *_ in _FLAGS}
    from_config = {}  # flag -> the config file's key that gave its value
    if args.config:
        types = {_dest(f): t for f, t, *_ in _FLAGS}
        for key, raw in load_config(args.config, cli.named(args, "--config")).items():
            dest = key.replace("-", "_")
            if dest not in types:
                raise AnalysisError(f"{args.config}: unknown key {key!r} "
                                    f"(known: {', '.join(sorted(types))})")
            if dest in given or raw is None:  # null: the key left out, the flag at its default
                continue
            try:
                values[dest] = _from_config(types[dest], raw)
            except (TypeError, ValueError) as e:
                raise AnalysisError(f"{args.config}: {key}: {e}") from None
            from_config[_flag(dest)] = key
    for required in ("nodes", "sustained_tflops"):
        if values[required] is None:
            raise AnalysisError(f"{_flag(required)} is required (flag, environment or --config)")

    def name(flag: str) -> str:
        key = from_config.get(flag)
        return f"{flag} (from {key} in {args.config})" if key else cli.named(args, flag)

    known = {f.name for f in fields(JobSpec)}
    return JobSpec(**{k: v for k, v in values.items() if k in known}), name


def _from_config(typ, raw):
    """A config file's value as its flag's type would read it. ``int(128.5)`` is 128 and
    ``int(True)`` 1: a count given as a fraction or a boolean was silently truncated, where the
    same value as a flag is refused. A whole float (``1.0e+6``) is still a count."""
    if isinstance(raw, bool) or (typ is int and isinstance(raw, float) and not raw.is_integer()):
        raise ValueError(f"{raw!r} is not {'an integer' if typ is int else 'a number'}")
    return typ(raw)


def load_config(path: str, flag: str) -> dict:
    """The mapping the file at ``path`` holds; errors name it as ``flag`` (``cli.named``'s)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AnalysisError(f"cannot read {flag} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise AnalysisError(f"{flag} {path} is not a text file (YAML or JSON)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:  # on one line: str(e) quotes the line at fault and a caret under it
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise AnalysisError(f"{flag} {path} is not valid YAML/JSON: {problem}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise AnalysisError(f"{flag} {path} must hold a mapping of flag names to values")
    return data


def summary(spec: JobSpec, e: Estimate) -> str:
    lay = f"TP {spec.tp} x PP {spec.pp} x DP {e.dp}"
    lines = [
        f"syncwatch jct: {plural(e.gpus, 'GPU', ',')} ({plural(e.nodes, 'node', ',')} x {spec.gpus_per_node}), {lay}, "
        f"{spec.algorithm} all-reduce",
        f"  theoretical minimum     {human_seconds(e.theoretical_min_seconds)}"
        f"   ({e.total_flops:.3g} FLOP at {spec.sustained_tflops:g} TFLOPS x {plural(e.gpus, 'GPU', ',')})",
        f"  predicted wall-clock    {predicted_text(e)}",
        f"  utilization efficiency  {pct(e.efficiency)}: {e.reading}; largest loss: {e.largest_loss}",
        f"  per step ({plural(e.steps, 'step', ',.0f')}) compute {human_seconds(e.compute_seconds)}, "
        f"bubble {human_seconds(e.bubble_seconds)}, jitter {human_seconds(e.jitter_seconds)}, "
        f"all-reduce {human_seconds(e.allreduce_intra_seconds + e.allreduce_inter_seconds)} "
        f"(intra {human_seconds(e.allreduce_intra_seconds)}, inter {human_seconds(e.allreduce_inter_seconds)}; "
        f"exposed {human_seconds(e.exposed_comm_seconds)}) = {human_seconds(e.step_seconds)}",
    ]
    if e.checkpoint_model == "interval":
        extra = ""
        if e.daly_interval_seconds:
            extra = (f" (Young {human_seconds(e.young_interval_seconds)}, "
                     f"Daly {human_seconds(e.daly_interval_seconds)})")
        lines.append(f"  checkpoints             every {human_seconds(e.checkpoint_interval_seconds)}{extra}, "
                     f"{spec.checkpoint_mode}, stall {human_seconds(e.checkpoint_stall_seconds)} each: "
                     f"{human_seconds(e.checkpoint_overhead_seconds)} in all")
    elif e.checkpoint_model == "free":
        give = "; give --checkpoint-seconds for what one costs" if not spec.checkpoint_seconds else ""
        lines.append("  checkpoints             assumed free and continuous (a stall of 0 s each): a failure "
                     f"re-runs no work{give}")
    else:
        lines.append("  checkpoints             none modelled")
    if e.mtbf_seconds and not e.finishes:
        lines.append(f"  failures                MTBF {human_seconds(e.mtbf_seconds)}, restart "
                     f"{human_seconds(e.restart_seconds)} each: failures strike faster than the job "
                     "recovers and checkpoints")
    elif e.mtbf_seconds:
        lines.append(f"  failures                MTBF {human_seconds(e.mtbf_seconds)}: ~{e.expected_failures:,.1f} "
                     f"expected, restart {human_seconds(e.restart_seconds)} each; "
                     f"{'with re-runs ' if e.checkpoint_model == 'interval' else ''}"
                     f"{human_seconds(e.failure_overhead_seconds)} in all")
    else:
        lines.append("  failures                none modelled (give --mtbf-hours)")
    w = e.sync_wall
    if not w:
        lines.append("  sync wall               not computed: more nodes all-reduce the gradient; give "
                     "--grad-bytes or --params")
    else:
        if not w["finishes"]:
            lines.append(f"  sync wall               none: the job cannot be expected to finish at any node count "
                         f"up to {w['curve'][-1]['nodes']:,}")
        elif w["reached"]:
            lines.append(f"  sync wall               {plural(w['nodes'], 'node', ',')} (predicted "
                         f"{human_seconds(w['predicted_seconds'])}); beyond it adding nodes no longer "
                         "shortens the job")
        else:
            lines.append(f"  sync wall               not reached up to {w['nodes']:,} nodes "
                         f"(limited by the {w['limited_by']}; predicted {human_seconds(w['predicted_seconds'])} there)")
    return "\n".join(lines)


def predicted_text(e: Estimate) -> str:
    if e.finishes:
        return human_seconds(e.predicted_seconds)
    return (f"never: the job cannot be expected to finish (a failure every {human_seconds(e.mtbf_seconds)} "
            f"against a restart of {human_seconds(e.restart_seconds)}; without failures "
            f"{human_seconds(e.solve_seconds)})")


@command("jct")
def run(args) -> int:
    spec, name = spec_from_args(args)
    e = estimate(spec, name=name)
    if args.json:
        emit_json({"spec": asdict(spec), "estimate": e.to_dict()})
    else:
        print(summary(spec, e))
    return 0
