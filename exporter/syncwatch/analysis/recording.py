"""A recorded run: per-step truth in a JSON file, so ``diagnose``/``project``/``report`` work offline.

Format ``syncwatch-run/1``::

    {"format": "syncwatch-run/1", "job": "sim-healthy", "samples_per_step": 32,
     "rank_node": ["node-00", "node-00", ...],          # node of each global rank
     "steps": [{"t": 1700000000.0, "step": 1, "attempt": 0, "seconds": 1.17,
                "waits": [0.16, 0.19, ...], "checkpoint": 0.0}, ...],   # t = step start (wall)
     "restarts": [{"t": ..., "failed_step": 130, "resume_step": 101, "attempt": 1}],
     "hardware": {"gpu_temperature_celsius": {"node-00": [[t, v], ...]}, ...}}   # optional

``checkpoint`` is the time the step spent checkpointing, global rank 0's (what the daemon's
``syncwatch_checkpoint_seconds_total`` counts): a step with one is a checkpoint, and its time the
checkpoint's cost. A rank's compute time in a step is ``seconds - waits[i]`` (the step ends at
the collective's release for every rank); its slack ``waits[i] - min(waits)``; the last arrival
has the smallest wait. ``from_ground_truth`` turns the simulator's ``GroundTruth`` into this format.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..daemon.config import DaemonConfig
from ..daemon.state import cv_steps
from .common import AnalysisError, lag1
from .view import AUTOCORRELATION_MIN_STEPS, JobView, windows

FORMAT = "syncwatch-run/1"
MIN_WINDOW_STEPS = 10  # a window holds at least this many steps: shares of last arrivals need a sample
TRAILING = 100  # steps behind the daemon's step CV / autocorrelation gauges (window W)


def from_ground_truth(truth, start_wall: float = 0.0, node_prefix: str = "sim-node-") -> dict:
    """A simulator ``GroundTruth`` (with ``keep_steps``) as a ``syncwatch-run/1`` dict.

    The simulator's virtual time starts at 0; ``start_wall`` places it on the wall clock.
    """
    p = truth.params
    ckpt = 5  # PHASES index of "checkpoint"
    return {
        "format": FORMAT,
        "job": truth.job,
        "samples_per_step": p.samples_per_step,
        "rank_node": [f"{node_prefix}{r // p.ranks_per_node:02d}" for r in range(p.world_size)],
        "steps": [{"t": start_wall + s.start, "step": s.step, "attempt": s.attempt,
                   "seconds": s.step_seconds, "waits": list(s.waits), "checkpoint": s.phases[0][ckpt]}
                  for s in truth.steps],
        "restarts": [{"t": start_wall + r.start, "failed_step": r.failed_step,
                      "resume_step": r.resume_step, "attempt": r.attempt} for r in truth.restarts],
    }


def save(run: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(run, separators=(",", ":")))


def load(path: str | Path) -> dict:
    """Read and check a recorded run; its steps come back in the order they ended.

    Every field the analysis reads is checked here, so a hand-edited or truncated file gets one
    line naming the bad field (exit 2) instead of a traceback or NaN figures further on.
    """
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise AnalysisError(f"cannot read --input {path}: {e.strerror}") from None
    except ValueError as e:
        raise AnalysisError(f"--input {path} is not JSON: {e}") from None
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise AnalysisError(f"--input {path} is not a recorded run (expected \"format\": \"{FORMAT}\")")

    def bad(where: str, what: str):
        return AnalysisError(f"--input {path}: {where} is malformed ({what})")

    if not isinstance(run.get("job", ""), str):
        raise bad("job", "needs the train job's name, a string")
    nodes = run.get("rank_node")
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise bad("rank_node", "needs a list of node names, one per global rank")
    if not nodes:
        raise AnalysisError(f"--input {path}: rank_node lists no ranks")
    world = len(nodes)
    if not _number(run.get("samples_per_step", 0) or 0):
        raise bad("samples_per_step", "needs a number ≥ 0")
    steps = run.get("steps")
    if not isinstance(steps, list):
        raise bad("steps", "needs a list of steps")
    for i, st in enumerate(steps):
        name = f"step #{i}" + (f" (step {st['step']})" if isinstance(st, dict) and "step" in st else "")
        ok = (isinstance(st, dict) and _number(st.get("t"), low=-math.inf) and _number(st.get("seconds"))
              and _number(st.get("checkpoint", 0.0)) and isinstance(st.get("waits"), list)
              and len(st["waits"]) == world and all(_number(w) for w in st["waits"]))
        if not ok:
            raise bad(name, f"needs t, seconds > 0, optional checkpoint ≥ 0 and {world} waits ≥ 0, "
                            "all finite numbers")
        # a step takes time, and its waits and checkpoint are parts of it: a step of 0 s divided
        # by zero in project and report, and a wait longer than its step read a sync tax of 525 %
        if st["seconds"] <= 0:
            raise bad(name, f"seconds is {st['seconds']}: a step lasts more than 0 s")
        longest = max(range(world), key=lambda r: st["waits"][r])
        if st["waits"][longest] > st["seconds"]:
            raise bad(name, f"rank {longest} waits {st['waits'][longest]} s in a step of {st['seconds']} s: "
                            "a wait is part of its step")
        if st.get("checkpoint", 0.0) > st["seconds"]:
            raise bad(name, f"checkpoint of {st['checkpoint']} s in a step of {st['seconds']} s: a checkpoint "
                            "is part of its step")
    steps.sort(key=lambda st: st["t"] + st["seconds"])
    restarts = run.get("restarts") or []
    if not isinstance(restarts, list):
        raise bad("restarts", "needs a list of restarts")
    for i, r in enumerate(restarts):
        if not (isinstance(r, dict) and _number(r.get("t"), low=-math.inf)
                and all(_number(r.get(k)) for k in ("failed_step", "resume_step"))):
            raise bad(f"restart #{i}", "needs t, failed_step and resume_step, all finite numbers")
    hardware = run.get("hardware") or {}
    ok = isinstance(hardware, dict) and all(
        isinstance(rows, dict) and all(
            isinstance(points, list) and all(
                isinstance(pt, list) and len(pt) == 2 and all(_number(x, low=-math.inf) for x in pt)
                for pt in points)
            for points in rows.values())
        for rows in hardware.values())
    if not ok:
        raise bad("hardware", "needs {series: {node: [[t, value], ...]}} with finite numbers")
    return run


def _number(x, low: float = 0.0) -> bool:
    """A finite JSON number (not a boolean) of at least ``low``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def select(run: dict, start: float | None, end: float | None) -> list[dict]:
    """The steps that ended inside [start, end] (all when not given)."""
    lo = -math.inf if start is None else start
    hi = math.inf if end is None else end
    return [s for s in run["steps"] if lo <= s["t"] + s["seconds"] <= hi]


def to_view(run: dict, source: str, start: float | None = None, end: float | None = None,
            min_window: float | None = None) -> JobView:
    """The run's steps that ended in [start, end] as a view, in windows of at least ``min_window``
    seconds (``--window``) and of at least ``MIN_WINDOW_STEPS`` mean steps."""
    steps = select(run, start, end)
    if not steps:
        raise AnalysisError(f"{source}: no step of {run.get('job')!r} ends in the time range (empty range)")
    t0 = steps[0]["t"] if start is None else start
    t1 = steps[-1]["t"] + steps[-1]["seconds"] if end is None else end
    mean_step = sum(s["seconds"] for s in steps) / len(steps)
    width, times = windows(t0, t1 + 1e-9, max(min_window or 0.0, MIN_WINDOW_STEPS * mean_step))
    world = len(run["rank_node"])
    n = len(times)
    per_rank = {name: {r: [0.0] * n for r in range(world)}
                for name in ("steps", "step_seconds", "sync_seconds", "slack_seconds", "last_arrivals",
                             "samples")}
    spr = float(run.get("samples_per_step") or 0.0)
    cv: list[float | None] = [None] * n
    ac: list[float | None] = [None] * n
    w = 0
    for s, recent in _daemon_windows(run["steps"], steps):
        done = s["t"] + s["seconds"]
        while w < n - 1 and done > times[w]:
            w += 1
        waits = s["waits"]
        lo = min(waits)
        for r, wait in enumerate(waits):
            per_rank["steps"][r][w] += 1
            per_rank["step_seconds"][r][w] += s["seconds"]
            per_rank["sync_seconds"][r][w] += wait
            per_rank["slack_seconds"][r][w] += wait - lo
            per_rank["samples"][r][w] += spr
            if wait <= lo:
                per_rank["last_arrivals"][r][w] += 1
        cv[w] = _cv(recent[len(recent) - cv_steps(recent, DaemonConfig.cv_seconds):])
        ac[w] = lag1(recent, min_points=AUTOCORRELATION_MIN_STEPS)
    restarts = run.get("restarts") or []
    rerun = []
    for t in times:
        past = [r for r in restarts if r["t"] <= t]
        rerun.append(float(sum(r["failed_step"] - r["resume_step"] + 1 for r in past)))
    saves = [s["checkpoint"] for s in steps if s.get("checkpoint", 0.0) > 0]
    hardware = {}
    for name, rows in (run.get("hardware") or {}).items():
        hardware[name] = {node: _window_mean(points, times, width) for node, points in rows.items()}
    return JobView(
        job=run.get("job", "recorded"), source=source, start=t0, end=t1, window=width, times=times,
        rank_node=dict(enumerate(run["rank_node"])), per_rank=per_rank, cv=cv, autocorrelation=ac,
        restarts=[float(sum(1 for r in restarts if r["t"] <= t)) for t in times], rerun_steps=rerun,
        hardware=hardware, samples_per_rank_step=spr or None,
        checkpoints=float(len(saves)), checkpoint_cost=sum(saves) / len(saves) if saves else None,
        restarts_at_start=float(sum(1 for r in restarts if r["t"] <= t0)),
        rerun_steps_at_start=float(sum(r["failed_step"] - r["resume_step"] + 1 for r in restarts if r["t"] <= t0)))


def _daemon_windows(every: list[dict], steps: list[dict]):
    """Each of ``steps`` (some of ``every``, in the same order) with the step times behind the
    daemon's autocorrelation gauge once its record came in (its CV's: the latest of them that
    took its --cv-seconds, ``cv_steps``): the last ``TRAILING``
    steps of its attempt's processes, from their second step (the first is the warm-up), each
    less its checkpoint (a planned pause, not jitter), steps before the range included.

    They were the range's own steps with their checkpoints: the restarts scenario's 0.5 s save
    every 50 steps of 1.2 s read a step CV of 5.0 % where its daemons read 0.6 %."""
    wanted = {id(s) for s in steps}
    recent: list[float] = []
    attempt = None
    for i, s in enumerate(every):
        if i == 0 or s.get("attempt") != attempt:  # a new attempt's processes: a new window
            recent, attempt = [], s.get("attempt")
        else:
            recent.append(s["seconds"] - s.get("checkpoint", 0.0))
            del recent[:-TRAILING]
        if id(s) in wanted:
            yield s, recent


def _window_mean(points, times, width) -> list[float | None]:
    out = []
    for t in times:
        vals = [v for pt, v in points if t - width < pt <= t]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def _cv(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / m if m > 0 else None
