"""A synchronous data-parallel cluster, step by step, with its exact ground truth.

Pure Python, one seeded ``random.Random``: the same parameters and seed give the same run.

Every step, every rank computes its phases (data, forward, backward, optimizer, a checkpoint
every ``checkpoint_every`` steps and an evaluation every ``eval_every``) and then enters the
gradient collective:

    arrival_i   = sum of rank i's compute phases (all ranks start the step together)
    release     = max_i arrival_i + collective time (x congestion factor during an episode)
    wait_i      = release - arrival_i          (rank i's ``sync`` phase)
    step time   = release                      (the same for every rank)
    idle_i      = wait_i + rank i's own checkpoint and eval time (what the skew exchange compares)
    slack_i     = idle_i - min_j idle_j,  skew = max_i slack_i,  last arrival = argmin_j idle_j

A rank's compute time is ``compute_seconds`` x max(0.5, 1 + Gaussian jitter) x its
persistent-straggler, thermal and oscillation factors, plus a rare heavy-tailed stall (Pareto, capped). Fabric congestion
episodes inflate the collective time; their chance per step grows with nodes² (pairwise flow
collisions on an oversubscribed fabric); scheduled episodes (``congestion_every``) come besides.
Restarts fail the job after chosen steps and resume from the last checkpoint with a new attempt:
step numbers go back and the steps since the checkpoint are re-run. See docs/simulator.md for why each effect is there and how the defaults were fitted.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from ..protocol import MAX_SECONDS, PHASES

# the most standard deviations random.gauss() can draw: its radius is sqrt(-2 ln(1 - random())),
# and 1 - random() is at least 2**-53
GAUSS_MAX = math.sqrt(-2.0 * math.log(2.0 ** -53))
COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")
I_DATA, I_SYNC, I_CKPT, I_EVAL = (PHASES.index(name)
                                  for name in ("data", "sync", "checkpoint", "eval"))


def is_whole(value) -> bool:
    """An ``int`` and not a bool: 2.5, 2.0, "2", NaN and True are no count, rank or step number."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Params:
    """Everything the model needs. Defaults: the calibrated healthy cluster (docs/simulator.md)."""
    nodes: int = 4
    ranks_per_node: int = 8
    compute_seconds: float = 1.0            # mean compute time of one rank's step (all phases)
    phase_split: tuple[float, ...] = (0.05, 0.30, 0.55, 0.10)  # data, forward, backward, optimizer
    collective_seconds: float = 0.15        # gradient all-reduce once the last rank arrived
    jitter: float = 0.015                   # Gaussian sigma of compute, relative, per rank and step
    # (its factor floored at 0.5)
    stall_probability: float = 2e-4         # chance per rank and step of a heavy-tailed stall
    stall_seconds: float = 0.02             # Pareto scale (the smallest stall), x compute_seconds
    stall_alpha: float = 1.5                # Pareto tail index (smaller = heavier)
    stall_cap: float = 1.0                  # longest stall, x compute_seconds
    stall_at: tuple[int, ...] = ()          # steps at which global rank 0's data loading stalls ...
    stall_at_seconds: float = 1.0           # ... for this long, x compute_seconds (the drill's one stall)
    congestion_rate: float = 7e-5           # chance per step of a congestion episode = rate x nodes²
    congestion_max: float = 0.25            # ... capped here
    congestion_factor: float = 6.0          # collective time x this during an episode (+5x)
    congestion_steps: int = 1               # steps an episode lasts
    congestion_every: int = 0               # scheduled episodes every this many steps (0 = none),
    scheduled_congestion_steps: int = 1     # ... lasting this many steps ...
    scheduled_congestion_factor: float = 6.0  # ... with the collective time x this
    straggler_rank: int = -1                # persistent straggler (-1 = none) ...
    straggler_slowdown: float = 0.0         # ... slowed by this fraction ...
    straggler_from_step: int = 0            # ... from this step on
    thermal_amplitude: float = 0.0          # per-node slow sinusoid on compute, relative amplitude
    thermal_period_steps: int = 400         # its period in steps (each node its own phase)
    oscillation: float = 0.0                # compute x (1 + a) on odd steps, x (1 - a) on even
    checkpoint_every: int = 0               # checkpoint phase every this many steps (0 = never)
    checkpoint_seconds: float = 0.0         # its duration on every rank (but rank0_pauses), x compute
    eval_every: int = 0                     # eval phase every this many steps (0 = never)
    eval_seconds: float = 0.0               # its duration on every rank (but rank0_pauses), x compute
    rank0_pauses: bool = False              # checkpoints and evaluations on global rank 0 only
    # (torch's DDP tutorial saves from rank 0): the others wait for it in the collective (sync)
    fail_after: tuple[int, ...] = ()        # fail after this many executed steps (each), resume
    restart_seconds: float = 5.0            # time from a failure to the first step of the new attempt
    samples_per_step: float = 32.0          # samples per rank per step

    def __post_init__(self):
        # whole numbers, checked first (a string raised a TypeError naming nothing): nodes=2.5
        # failed later in the model (range() of a float), straggler_from_step=20.5 started the
        # straggler at step 21, and True counted as 1
        for name, least in (("nodes", 1), ("ranks_per_node", 1), ("thermal_period_steps", 1),
                            ("straggler_from_step", None)):
            value = getattr(self, name)
            if not (is_whole(value) and (least is None or value >= least)):
                bound = f" >= {least}" if least is not None else ""
                raise ValueError(f"{name} must be a whole number{bound}, not {value!r}")
        # NaN fails every comparison, so each check says what is valid (and a NaN is not)
        if (len(self.phase_split) != len(COMPUTE_PHASES)
                or not all(0 <= f < math.inf for f in self.phase_split)
                or abs(sum(self.phase_split) - 1) > 1e-9):
            raise ValueError(f"phase_split must be 4 fractions (>= 0) summing to 1, "
                             f"not {self.phase_split}")
        # a negative, infinite or NaN duration or amount would make every daemon reject the
        # rank's records (bad_value) while the truth counted them
        if not 0 < self.compute_seconds < math.inf:
            raise ValueError(f"compute_seconds must be positive and finite, not {self.compute_seconds}")
        for name in ("collective_seconds", "jitter", "stall_seconds", "stall_cap", "congestion_rate",
                     "congestion_factor", "scheduled_congestion_factor", "checkpoint_seconds",
                     "eval_seconds", "restart_seconds", "samples_per_step", "stall_at_seconds"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, not {getattr(self, name)}")
        for name in ("stall_probability", "congestion_max"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a probability (0 to 1), not {getattr(self, name)}")
        if not -1 < self.straggler_slowdown < math.inf:
            raise ValueError(f"straggler_slowdown must be > -1 (-1: no compute at all) and finite, "
                             f"not {self.straggler_slowdown}")
        for name in ("oscillation", "thermal_amplitude"):
            if not abs(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be within (-1, 1): compute x (1 - {name}) "
                                 f"must stay positive, not {getattr(self, name)}")
        if not 0 < self.stall_alpha < math.inf:
            raise ValueError(f"stall_alpha must be positive and finite, not {self.stall_alpha}")
        # counts of steps: congestion_steps=1.5 counted an episode down past 0 (-0.5), so no
        # random episode started again (2 congested steps in 2000 where 1 gives 313), and a
        # fractional every-N never divides a step number (NaN passed a "< 0" check)
        for name in ("checkpoint_every", "eval_every", "congestion_every", "congestion_steps",
                     "scheduled_congestion_steps"):
            value = getattr(self, name)
            if not (is_whole(value) and value >= 0):
                raise ValueError(f"{name} must be a whole number of steps >= 0, not {value!r}")
        # a failure after 0 steps restarted before any step ran, and a repeated count restarted
        # the new attempt before its first step (a restart with nothing re-run)
        if (not all(is_whole(n) and n >= 1 for n in self.fail_after)
                or len(set(self.fail_after)) != len(self.fail_after)):
            raise ValueError(f"fail_after must be distinct step counts >= 1, not {self.fail_after}")
        if not all(is_whole(n) and n >= 1 for n in self.stall_at):
            raise ValueError(f"stall_at must be step numbers >= 1, not {self.stall_at}")
        if self.fail_after and not self.checkpoint_every:
            raise ValueError("restarts need checkpoint_every > 0 to resume from")
        # a fractional rank matched no rank: the run had no straggler, and nothing said so
        if not (is_whole(self.straggler_rank) and -1 <= self.straggler_rank < self.world_size):
            raise ValueError(f"straggler_rank must be -1 (none) or a rank from 0 to "
                             f"{self.world_size - 1} (world size {self.world_size}), not "
                             f"{self.straggler_rank!r}")
        # a longer step (or phase, or wait) makes every daemon reject the record (bad_value)
        # while the truth counts it
        longest = self.longest_step_seconds
        if not longest <= MAX_SECONDS:
            most = MAX_SECONDS * self.compute_seconds / longest
            raise ValueError(f"compute_seconds must keep steps within the protocol's "
                             f"{MAX_SECONDS:g}-second limit on a duration (protocol.MAX_SECONDS; "
                             f"the daemons reject longer ones): {self.compute_seconds:g} gives "
                             f"steps of up to {longest:.4g} s with these parameters, at most "
                             f"{most:.4g} does")

    @property
    def longest_step_seconds(self) -> float:
        """The longest step these parameters can give: every compute factor at its largest
        (``random.gauss`` draws at most ``GAUSS_MAX`` sigmas), a stall at its cap, a checkpoint
        and an evaluation, the collective in the largest congestion factor."""
        compute = ((1 + abs(self.oscillation)) * (1 + abs(self.thermal_amplitude))
                   * max(0.5, 1 + self.jitter * GAUSS_MAX))
        if self.straggler_rank >= 0:
            compute *= max(1.0, 1 + self.straggler_slowdown)
        stall = ((self.stall_cap if self.stall_probability else 0.0)
                 + (self.stall_at_seconds if self.stall_at else 0.0))
        pauses = ((self.checkpoint_seconds if self.checkpoint_every else 0.0)
                  + (self.eval_seconds if self.eval_every else 0.0))
        congestion = max(1.0, self.congestion_factor if self.congestion_probability() else 1.0,
                         self.scheduled_congestion_factor if self.congestion_every else 1.0)
        return self.compute_seconds * (
            compute + stall + pauses + self.collective_seconds * congestion)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def congestion_probability(self) -> float:
        """The chance per step of a random congestion episode: rate x nodes², capped."""
        return min(self.congestion_max, self.congestion_rate * self.nodes ** 2)

    def with_(self, **changes) -> "Params":
        return replace(self, **changes)


@dataclass(slots=True)
class StepTruth:
    """One executed step, exactly. ``phases[i]`` is rank i's phase durations (``PHASES`` order)."""
    step: int                      # the job's step number (goes back after a restart)
    attempt: int
    start: float                   # virtual time the step started (all ranks)
    step_seconds: float
    waits: tuple[float, ...]
    phases: list[tuple[float, ...]]
    congested: bool
    # each rank's time off its compute: its wait and its own planned pauses, what the skew
    # exchange compares (a pause all ranks take alike changes no slack or skew)
    idle: tuple[float, ...]

    @property
    def min_wait(self) -> float:
        return min(self.idle)

    @property
    def skew(self) -> float:
        return max(self.idle) - min(self.idle)

    @property
    def slack(self) -> tuple[float, ...]:
        lo = self.min_wait
        return tuple(w - lo for w in self.idle)

    @property
    def last_arrivals(self) -> tuple[int, ...]:
        """Ranks with the least idle time (ties count for each, as ``skew.derive`` counts them)."""
        lo = self.min_wait
        return tuple(i for i, w in enumerate(self.idle) if w <= lo)


@dataclass(slots=True)
class Restart:
    """The job failed after ``failed_step``; the next attempt resumes at ``resume_step``."""
    failed_step: int
    resume_step: int
    attempt: int                   # the new attempt
    start: float                   # virtual time the new attempt's first step starts

    @property
    def rerun_steps(self) -> int:
        return self.failed_step - self.resume_step + 1


class Model:
    """Generates ``StepTruth`` (and ``Restart`` events) for one train job.

    ``next()`` returns the next event; virtual time advances by each step's time (and a restart's
    downtime). The model keeps no history: collect what you need from the events.
    """

    def __init__(self, params: Params, seed: int = 0):
        self.p = params
        self.rng = random.Random(seed)
        self.time = 0.0
        self.step = 0                  # last completed step number
        self.executed = 0              # steps executed, re-runs included
        self.attempt = 0
        self._congested_left = 0       # steps left of the random episode under way
        self._scheduled_left = 0       # ... and of the scheduled one
        self._fail_after = sorted(params.fail_after)
        n = params.nodes
        self._node_phase = [self.rng.uniform(0, 2 * math.pi) for _ in range(n)]

    def congestion_probability(self) -> float:
        return self.p.congestion_probability()

    def node_factors(self, step: int) -> list[float]:
        """Each node's thermal factor on its ranks' compute at ``step`` (1.0 without the effect)."""
        p = self.p
        if not p.thermal_amplitude:
            return [1.0] * p.nodes
        w = 2 * math.pi * step / p.thermal_period_steps
        return [1.0 + p.thermal_amplitude * math.sin(w + ph) for ph in self._node_phase]

    def _stall(self) -> float:
        p = self.p
        # Pareto(alpha) scaled to stall_seconds: inverse CDF of a uniform draw, capped.
        x = p.stall_seconds / (1.0 - self.rng.random()) ** (1.0 / p.stall_alpha)
        return min(x, p.stall_cap) * p.compute_seconds

    def next(self) -> StepTruth | Restart:
        p = self.p
        if self._fail_after and self.executed >= self._fail_after[0]:
            self._fail_after.pop(0)
            resume = self.step - self.step % p.checkpoint_every + 1
            self.attempt += 1
            self.time += p.restart_seconds * p.compute_seconds
            event = Restart(self.step, resume, self.attempt, self.time)
            self.step = resume - 1
            return event
        return self._next_step()

    def _next_step(self) -> StepTruth:
        p, rng = self.p, self.rng
        step = self.step + 1
        R = p.ranks_per_node
        node_factor = self.node_factors(step)
        osc = 1.0 + (p.oscillation if step % 2 else -p.oscillation)
        straggling = p.straggler_rank >= 0 and step >= p.straggler_from_step
        ckpt = (p.checkpoint_seconds * p.compute_seconds
                if p.checkpoint_every and step % p.checkpoint_every == 0 else 0.0)
        evaluation = (p.eval_seconds * p.compute_seconds
                      if p.eval_every and step % p.eval_every == 0 else 0.0)
        split = [f * p.compute_seconds for f in p.phase_split]
        once = p.stall_at_seconds * p.compute_seconds if step in p.stall_at else 0.0
        gauss, rand = rng.gauss, rng.random
        phases, arrivals, pauses = [], [], []
        for i in range(p.world_size):
            factor = osc * node_factor[i // R] * max(0.5, 1.0 + p.jitter * gauss(0.0, 1.0))
            if straggling and i == p.straggler_rank:
                factor *= 1.0 + p.straggler_slowdown
            comp = [s * factor for s in split]
            if rand() < p.stall_probability:
                comp[0] += self._stall()      # a stall lands in data loading (GC, I/O, page faults)
            if once and i == 0:
                comp[0] += once
            phases.append(comp)
            paused = (ckpt, evaluation) if i == 0 or not p.rank0_pauses else (0.0, 0.0)
            pauses.append(paused)
            # fsum: exactly rounded, so the same run on every CPython (3.12's sum() of floats
            # compensates its rounding, 3.11's does not: the golden exposition moved)
            arrivals.append(math.fsum(comp) + sum(paused))
        # the random episodes (the healthy cluster's) and the scheduled ones (the congestion
        # scenario's) are independent: a random draw whenever no random episode is under way,
        # whatever the schedule, and the larger factor where both are
        if self._congested_left == 0 and rand() < self.congestion_probability():
            self._congested_left = p.congestion_steps
        if p.congestion_every and step % p.congestion_every == 0:
            self._scheduled_left = p.scheduled_congestion_steps
        factors = []
        if self._congested_left > 0:
            self._congested_left -= 1
            factors.append(p.congestion_factor)
        if self._scheduled_left > 0:
            self._scheduled_left -= 1
            factors.append(p.scheduled_congestion_factor)
        congested = bool(factors)
        collective = p.collective_seconds * p.compute_seconds * (max(factors) if congested else 1.0)
        release = max(arrivals) + collective
        waits = tuple(release - a for a in arrivals)
        full = [(c[0], c[1], c[2], c[3], w, ck, 0.0, ev)
                for c, w, (ck, ev) in zip(phases, waits, pauses)]
        idle = tuple(w + ck + ev for w, (ck, ev) in zip(waits, pauses))
        truth = StepTruth(step, self.attempt, self.time, release, waits, full, congested, idle)
        self.time += release
        self.step = step
        self.executed += 1
        return truth


def step_cv(step_seconds) -> float:
    """Coefficient of variation (population standard deviation / mean) of step times."""
    xs = list(step_seconds)
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return math.sqrt(var) / mean if mean > 0 else 0.0


def lag1_autocorrelation(step_seconds) -> float:
    xs = list(step_seconds)
    if len(xs) < 3:
        return 0.0
    mean = sum(xs) / len(xs)
    den = sum((x - mean) ** 2 for x in xs)
    if den == 0:
        return 0.0
    return sum((a - mean) * (b - mean) for a, b in zip(xs, xs[1:])) / den


@dataclass
class SweepRow:
    nodes: int
    ranks: int
    steps: int
    cv: float
    paper_cv: float | None


PAPER_CV = {4: 0.02, 8: 0.04, 16: 0.09, 32: 0.15, 64: 0.22}  # seed paper, 8 GPUs per node


def scaling_sweep(node_counts=(4, 8, 16, 32, 64), ranks_per_node: int = 8, seed: int = 0,
                  rank_steps: int = 300_000, min_steps: int = 1500,
                  params: Params | None = None) -> list[SweepRow]:
    """Step-time CV of the default (or given) model at each node count.

    Each cluster size runs ``max(min_steps, rank_steps / ranks)`` steps: small clusters get more
    steps because their CV comes from rare events and needs many steps to estimate.
    """
    base = params or Params()
    rows = []
    for n in node_counts:
        p = base.with_(nodes=n, ranks_per_node=ranks_per_node, fail_after=())
        steps = max(min_steps, rank_steps // p.world_size)
        model = Model(p, seed=seed + n)
        times = [model._next_step().step_seconds for _ in range(steps)]
        rows.append(SweepRow(n, p.world_size, steps, step_cv(times), PAPER_CV.get(n)))
    return rows


# the calibration's comparison sweeps (docs/simulator.md): the default model less its effects
ABLATIONS = {"Gaussian jitter only": dict(stall_probability=0.0, congestion_rate=0.0),
             "+ stalls, no congestion": dict(congestion_rate=0.0)}


def format_sweep(rows: list[SweepRow], digits: int = 3) -> str:
    lines = ["nodes  ranks  steps   step CV   paper CV",
             "-----  -----  -----  --------  --------"]
    for r in rows:
        paper = f"{r.paper_cv:8.3f}" if r.paper_cv is not None else "       -"
        lines.append(f"{r.nodes:5d}  {r.ranks:5d}  {r.steps:5d}  {r.cv:8.{digits}f}  {paper}")
    return "\n".join(lines)


__all__ = ["Params", "Model", "StepTruth", "Restart", "step_cv", "lag1_autocorrelation",
           "scaling_sweep", "format_sweep", "PAPER_CV", "SweepRow", "ABLATIONS"]
