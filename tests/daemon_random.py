"""Randomized, seeded histories of jobs' record streams driven through ``State`` in-process, checked
against a small hand-kept reference after every sweep / scrape.

A history: 1-2 jobs of 1-4 ranks, each a series of launches (a new attempt, a restart in place:
new pids, same attempt; a container restarted in place: the same pids again, new nonces, the
attempt the same or back to the first launch's), each rank's process stepping with cumulative totals, heartbeats every
5 s (carrying the last completed step, possibly ahead of its delayed step record), in-process
resumes (same pid, attempt + 1, step numbers back to the checkpoint), ends that are graceful (the
last step record sent again with the last exchange window's totals, then an end record), a crash
(nothing more), a hang (heartbeats only, then killed or a failed end record); random loss, ranks
going silent for a while, daemon restarts (a fresh State, records lost while it is down); garbage
and a step count that goes down, which must be rejected with their reason.

Run many: ``python tests/daemon_random.py 2000 [first seed]``.
"""

from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass, field, replace

from syncwatch.daemon.config import DaemonConfig
from syncwatch.daemon.exposition import families
from syncwatch.daemon.state import COUNTED_HERE, SUPERSEDE_SECONDS, State
from syncwatch.protocol import (PHASES, REJECT_REASONS, SKEW_BUCKETS, Cumulative, Decoder, Encoder,
                                Identity, ProtocolError, SkewHistogram)

WALL0 = 1_800_000_000.0
TTL, GRACE = 60.0, 120.0
NPH = len(PHASES)
CK = PHASES.index("checkpoint")
SWEEP_EVERY = 1.0


@dataclass
class Msg:
    t: float
    job: str
    rank: int
    pid: tuple[int, int]        # the process: (pid, nonce)
    attempt: int
    kind: str                   # step, hb, end, garbage
    data: bytes
    step: int = -1              # step records: the step; hb / end: last_step
    wall: float = 0.0           # step: its wall time; hb: last_step_wall_time
    totals: Cumulative | None = None
    resend: bool = False
    bad: str | None = None      # a record that must be rejected with this reason (garbage)
    lost: bool = False


class Proc:
    """One rank process as the instrumentation runs it."""

    def __init__(self, sim, job, rank, world, attempt, pid, exact):
        self.sim, self.job, self.rank, self.world = sim, job, rank, world
        self.pid, self.exact = pid, exact
        self.set_attempt(attempt)
        self.totals = Cumulative()
        self.last_step, self.last_wall = 0, 0.0
        self.last = None            # (step, wall, step_s) of the last step, for the re-send
        self.skew = SkewHistogram() if rank == 0 else None
        self.send_t = self.hb_t = 0.0
        self.alive = True

    def set_attempt(self, attempt):
        self.attempt = attempt
        self.ident = Identity(train_job=self.job, attempt=attempt, rank=self.rank,
                              local_rank=self.rank, world_size=self.world, node="node-1",
                              pid=self.pid[0], nonce=self.pid[1])
        self.enc = Encoder(self.ident)

    def _send(self, t, kind, data, **kw):
        # one sender: in order, but for a heartbeat, which goes while a step record waits for its
        # timings (lazily timed on CUDA): only after the heartbeat before it, so it may arrive
        # ahead of the step record it reports
        t = max(t, (self.hb_t if kind == "hb" else self.send_t) + 1e-6)
        self.send_t = max(self.send_t, t)
        if kind == "hb":
            self.hb_t = t
        self.sim.emit(Msg(t, self.job, self.rank, self.pid, self.attempt, kind, data, **kw))

    def step(self, t, step, d, checkpoint):
        rng = self.sim.rng
        phases = [d / NPH] * NPH
        if checkpoint:
            phases[CK] += 0.5
        t0 = self.totals
        slack = rng.random() * 0.01 if self.exact else 0.0
        self.totals = Cumulative(
            steps=t0.steps + 1, step_seconds=t0.step_seconds + sum(phases),
            phase_seconds=tuple(a + b for a, b in zip(t0.phase_seconds, phases)),
            slack_seconds=t0.slack_seconds + slack,
            last_arrivals=t0.last_arrivals + (self.exact and rng.random() < 0.3),
            samples=t0.samples + 32, tokens=t0.tokens + 3200,
            checkpoints=t0.checkpoints + int(checkpoint))
        if self.skew is not None:
            s = self.skew
            self.skew = SkewHistogram(s.count + 1, s.sum + 0.001, tuple(b + 1 for b in s.buckets))
        wall = WALL0 + t
        self.last_step, self.last_wall = step, wall
        self.last = (step, wall, sum(phases), tuple(phases))
        self._send_step(t + rng.choice((0.0, 0.0, rng.random() * 0.3)))

    def _send_step(self, t, resend=False):
        step, wall, d, phases = self.last
        data = self.enc.step(step, wall, d, 0.001, phases, step * 2, 32, 3200, self.totals,
                             exact=self.exact, has_tokens=True, skew=self.skew)
        self._send(t, "step", data, step=step, wall=wall, totals=self.totals, resend=resend)

    def heartbeat(self, t, phase="forward"):
        data = self.enc.heartbeat(WALL0 + t, self.last_step, self.last_wall, phase, 1.0,
                                  self.last_step * 2)
        self._send(t, "hb", data, step=self.last_step, wall=self.last_wall)

    def end(self, t, reason, resend):
        if resend and self.last is not None:
            t0 = self.totals
            self.totals = replace(t0, slack_seconds=t0.slack_seconds + (0.5 if self.exact else 0),
                                  last_arrivals=t0.last_arrivals + int(
                                      self.exact and t0.last_arrivals < t0.steps))
            if self.skew is not None:
                s = self.skew
                self.skew = SkewHistogram(s.count + 3, s.sum + 0.003, tuple(b + 3 for b in s.buckets))
            self._send_step(t, resend=True)
        self._send(t + 0.001, "end", self.enc.end(WALL0 + t, self.last_step, reason),
                   step=self.last_step)
        self.alive = False


class Sim:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.msgs: list[Msg] = []
        self.pids = itertools.count(1000)
        self.nonces = itertools.count(1)

    def emit(self, m):
        self.msgs.append(m)

    def job(self, name, t):
        rng = self.rng
        world = rng.randint(1, 4)
        exact = [rng.random() < 0.6 for _ in range(world)]
        ck_every = rng.choice((3, 5, 10))
        launcher = first_launcher = rng.choice((0, 0, 2))
        start = rng.choice((0, 1))
        ckpt = None
        pids = []
        for launch in range(rng.randint(1, 5)):
            if launch and rng.random() < 0.3:  # a container restarted in place: the same pids
                launcher = rng.choice((launcher, first_launcher))
            else:
                pids = [next(self.pids) for _ in range(world)]
            procs = [Proc(self, name, r, world, launcher, (pids[r], next(self.nonces)), exact[r])
                     for r in range(world)]
            hb_next = t + rng.random() * 5

            def advance(t_new, phase="forward"):
                nonlocal hb_next
                while hb_next < t_new:
                    for p in procs:
                        if p.alive:
                            p.heartbeat(hb_next + rng.random() * 0.01, phase)
                    hb_next += 5.0

            t += rng.uniform(0.5, 8)  # set-up before the first step
            n = rng.choice((0, rng.randint(1, 8), rng.randint(5, 60)))
            resume_at = rng.randrange(n) if n and rng.random() < 0.25 else None
            step = start
            for i in range(n):
                if i == resume_at and ckpt is not None:  # in-process resume: attempt + 1
                    step = ckpt + 1 if rng.random() < 0.8 else max(0, step - rng.randint(1, 5))
                    for p in procs:
                        p.set_attempt(p.attempt + 1)
                d = rng.choice((rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(10, 40)))
                advance(t + d)
                t += d
                checkpoint = step % ck_every == 0
                order = list(procs)
                rng.shuffle(order)
                for p in order:
                    p.step(t + rng.random() * 0.05, step, d, checkpoint)
                if checkpoint:
                    ckpt = step
                step += 1
            mode = rng.choice(("graceful", "graceful", "crash", "hang", "failed"))
            if mode == "hang":
                hang = rng.uniform(5, 150)
                advance(t + hang, "sync")
                t += hang
                if rng.random() < 0.5:
                    for p in procs:
                        p.end(t + rng.random() * 0.1, "failed", False)
            elif mode == "crash":
                t += rng.random() * 3
                advance(t)
            else:
                t += rng.random()
                advance(t)
                for p in procs:
                    p.end(t + rng.random() * 0.1, "completed" if mode == "graceful" else "failed",
                          mode == "graceful")
            t += rng.choice((rng.uniform(0.5, 20), rng.uniform(0.5, 250)))
            if rng.random() < 0.7:
                launcher += rng.randint(1, 3)
            last = step - 1
            start = (last + 1 if rng.random() < 0.15 or ckpt is None and n
                     else (ckpt + 1 if ckpt is not None else start))
        return t

    def history(self):
        rng = self.rng
        t_end = 0.0
        for j in range(rng.randint(1, 2)):
            t_end = max(t_end, self.job(f"job-{j}", rng.uniform(0, 30)))
        msgs = self.msgs
        # loss: random, and ranks silent for a while (their records lost)
        for m in msgs:
            if rng.random() < 0.02:
                m.lost = True
        for _ in range(rng.randint(0, 3)):
            job, rank = f"job-{rng.randint(0, 1)}", rng.randint(0, 3)
            a = rng.uniform(0, t_end)
            b = a + rng.uniform(10, 150)
            for m in msgs:
                if m.job == job and m.rank == rank and a <= m.t <= b:
                    m.lost = True
        # garbage
        real = [m.data for m in msgs]
        for _ in range(rng.randint(0, 3) if real else 0):
            src = rng.choice(real)
            kind = rng.choice(("bad_magic", "truncated", "unknown_version"))
            data = {"bad_magic": b"XX" + src[2:], "truncated": src[:5],
                    "unknown_version": src[:2] + b"\x09" + src[3:]}[kind]
            msgs.append(Msg(rng.uniform(0, t_end), "", 0, (0, 0), 0, "garbage", data, bad=kind))
        msgs.sort(key=lambda m: m.t)
        # daemon restarts: down for a few seconds, then a fresh State
        restarts = sorted(rng.uniform(0, t_end) for _ in range(rng.choice((0, 0, 1, 2))))
        return msgs, restarts, t_end


# ---------------------------------------------------------------------------------------------
# reference


@dataclass
class RRank:
    key: tuple[tuple[int, int], int]  # ((pid, nonce), attempt)
    seen: float
    superseded: tuple[tuple[int, int], int] | None = None
    ended: bool = False
    totals: Cumulative | None = None
    step_seen: int = -1
    last_step: int = -1         # from step records and heartbeats
    last_wall: float = 0.0
    end_step: int = -1          # an end record's last step


@dataclass
class R0:
    key: tuple[tuple[int, int], int]
    first: int | None = None    # first step record applied
    max_step: int = -1          # highest step of its step records
    max_any: int = -1           # ... of any record (heartbeats', end records' last step)
    ck: tuple[float, int] = (0.0, 0)


_incarnations = itertools.count()


@dataclass
class RJob:
    seen: float
    incarnation: int = field(default_factory=lambda: next(_incarnations))
    ranks: dict = field(default_factory=dict)
    r0: list = field(default_factory=list)
    world: int = 0


class Ref:
    def __init__(self):
        self.jobs: dict[str, RJob] = {}
        self.records = 0
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.cov: dict[str, int] = {}

    def c(self, what):
        self.cov[what] = self.cov.get(what, 0) + 1

    def apply(self, m: Msg, now: float) -> str | None:
        """The reason the daemon must reject ``m`` with, None if it accepts it."""
        if m.bad:
            self.rejected[m.bad] += 1
            return m.bad
        job = self.jobs.get(m.job)
        if job is None:
            job = self.jobs[m.job] = RJob(now)
        key = (m.pid, m.attempt)
        r = job.ranks.get(m.rank)
        if r is None:
            self.c("rank state new")
            r = job.ranks[m.rank] = RRank(key, now)
        elif key == r.key:
            pass
        elif key == r.superseded:
            self.rejected["identity_conflict"] += 1
            return "identity_conflict"
        elif m.attempt < r.key[1] and (m.pid == r.key[0] or not (
                r.ended or now - r.seen > SUPERSEDE_SECONDS)):
            self.records += 1
            self.c("stale")
            return None  # stale
        else:
            self.c("takeover lower attempt" if m.attempt < r.key[1] else
                   "takeover same attempt" if m.attempt == r.key[1] else
                   "takeover same process" if m.pid == r.key[0] else "takeover higher attempt")
            sup = r.key if r.key[1] == m.attempt else None
            r = job.ranks[m.rank] = RRank(key, now, superseded=sup)
        if (m.kind == "step" and r.totals is not None and m.step > r.step_seen
                and m.totals.steps < r.totals.steps):
            self.rejected["bad_value"] += 1
            return "bad_value"
        self.records += 1
        r.seen = job.seen = now
        e = None
        if m.rank == 0:
            if not job.r0 or job.r0[-1].key != key:
                job.r0.append(R0(key))
            e = job.r0[-1]
        if m.kind == "step":
            if m.step > r.step_seen:
                r.step_seen, r.totals = m.step, m.totals
                if m.step >= r.last_step:
                    r.last_step, r.last_wall = m.step, m.wall
                if e is not None:
                    if e.first is None:
                        e.first = m.step
                    e.max_step = max(e.max_step, m.step)
                    e.max_any = max(e.max_any, m.step)
                    e.ck = (m.totals.phase_seconds[CK], m.totals.checkpoints)
            elif m.step == r.step_seen and m.totals.steps == r.totals.steps:
                if (m.totals.slack_seconds >= r.totals.slack_seconds
                        and m.totals.last_arrivals >= r.totals.last_arrivals):
                    self.c("resend applied")
                    r.totals = m.totals
        elif m.kind == "hb":
            r.ended = False
            if m.wall > 0 and m.step >= r.last_step:
                r.last_step, r.last_wall = m.step, m.wall
            if e is not None and m.wall > 0:
                e.max_any = max(e.max_any, m.step)
        else:
            r.ended = True
            r.end_step = max(r.end_step, m.step)
            if e is not None and (m.step > 0 or r.last_wall > 0):  # 0: no step yet, or step 0
                e.max_any = max(e.max_any, m.step)
        return None

    def expire(self, now):
        for name in list(self.jobs):
            job = self.jobs[name]
            for k in [k for k, r in job.ranks.items()
                      if now - r.seen > (GRACE if r.ended else TTL)]:
                self.c("rank expired")
                del job.ranks[k]
            if not job.ranks and now - job.seen > GRACE:
                self.c("job removed")
                del self.jobs[name]

    @staticmethod
    def restarts(job: RJob):
        """(restarts, re-run steps) by the doc's rule over rank 0's processes this daemon saw
        in the job's lifetime; the previous highest step as any record told it (heartbeats and
        end records carry it too)."""
        restarts = rerun = 0
        high = -1
        pending = False
        for i, e in enumerate(job.r0):
            if i:
                prev = job.r0[i - 1]
                h = prev.max_any
                if h >= 0:
                    high = h
                if e.key[1] > prev.key[1]:
                    restarts += 1
                    counted = True
                else:
                    counted = e.first is not None and high >= 0 and e.first <= high
                    restarts += counted
                pending = counted
            if pending and e.first is not None and high >= 0:
                rerun += max(0, high - e.first + 1)
                pending = False
        return restarts, rerun


# ---------------------------------------------------------------------------------------------
# driver


class Violation(AssertionError):
    pass


def run(seed: int) -> dict:
    sim = Sim(seed)
    msgs, restarts, t_end = sim.history()
    now = [0.0]
    cfg = DaemonConfig(socket=None, rank_ttl=TTL, job_grace=GRACE)
    stats = {"max_restarts": 0, "records": 0, "snapshots": 0, "daemon_restarts": len(restarts), "lost": 0,
             "notes": []}
    gen = 0

    cov = {}

    def fresh():
        return State(cfg, clock=lambda: now[0]), Decoder(), Ref()

    def fold(ref):
        for k, v in ref.cov.items():
            cov[k] = cov.get(k, 0) + v
        for j in ref.jobs.values():
            rs, rr = Ref.restarts(j)
            cov["restarts counted"] = cov.get("restarts counted", 0) + rs
            cov["rerun steps counted"] = cov.get("rerun steps counted", 0) + rr

    state, dec, ref = fresh()
    prev_counters: dict = {}
    prev_job: dict = {}
    down_until = -1.0
    next_sweep = SWEEP_EVERY
    next_snap = 10.0

    def fail(what):
        raise Violation(f"seed {seed} t={now[0]:.3f} gen {gen}: {what}")

    def check():
        stats["snapshots"] += 1
        ref.expire(now[0])
        snap = state.snapshot()
        fams = families(snap)  # renders
        series = {}
        for f in fams:
            for s in f.samples:
                series[(s.name, tuple(sorted(s.labels.items())))] = s.value
        if snap.records != ref.records:
            fail(f"records {snap.records} != {ref.records}")
        if snap.rejected != ref.rejected:
            fail(f"rejected {snap.rejected} != {ref.rejected}")
        if [j.train_job for j in snap.jobs] != sorted(ref.jobs):
            fail(f"jobs {[j.train_job for j in snap.jobs]} != {sorted(ref.jobs)}")
        for jv in snap.jobs:
            rj = ref.jobs[jv.train_job]
            if [v.ident.rank for v in jv.ranks] != sorted(rj.ranks):
                fail(f"{jv.train_job} ranks {[v.ident.rank for v in jv.ranks]} != {sorted(rj.ranks)}")
            for v in jv.ranks:
                rr = rj.ranks[v.ident.rank]
                key = (v.ident.process, v.ident.attempt)
                where = f"{jv.train_job} rank {v.ident.rank} {key}"
                if key != rr.key:
                    fail(f"{where}: process != reference {rr.key}")
                if v.totals != rr.totals:
                    fail(f"{where}: totals {v.totals} != {rr.totals}")
                want_step = max(rr.last_step, rr.end_step)
                if v.last_step != want_step:
                    fail(f"{where}: last_step {v.last_step} != {want_step}")
                if v.last_step_wall != rr.last_wall:
                    fail(f"{where}: last_step_wall {v.last_step_wall} != {rr.last_wall}")
                # every counter of the exposition never decreases for one process
                lab = (("rank", str(v.ident.rank)), ("train_job", jv.train_job))
                for (name, labels), val in series.items():
                    if not name.endswith("_total") or not set(lab) <= set(labels):
                        continue
                    k = (gen, name, labels)
                    old = prev_counters.get(k)
                    if old is not None and old[0] == key and val < old[1]:
                        fail(f"{where}: {name}{dict(labels)} went down {old[1]} -> {val}")
                    prev_counters[k] = (key, val)
            has0 = 0 in rj.ranks
            if jv.has_rank0 != has0:
                fail(f"{jv.train_job}: has_rank0 {jv.has_rank0}")
            if rj.r0:
                cur = rj.r0[-1]
                if (jv.attempt, jv.checkpoint_seconds, jv.checkpoints) != (cur.key[1], *cur.ck):
                    fail(f"{jv.train_job}: attempt/checkpoints {(jv.attempt, jv.checkpoint_seconds, jv.checkpoints)} != {(cur.key[1], *cur.ck)}")
            want = Ref.restarts(rj)
            stats["max_restarts"] = max(stats["max_restarts"], want[0])
            if (jv.restarts, jv.rerun_steps) != want:
                fail(f"{jv.train_job}: restarts, rerun {(jv.restarts, jv.rerun_steps)} != {want}"
                     f"; rank 0 processes {rj.r0}")
            if has0:
                for name, v in (("syncwatch_job_restarts_total", jv.restarts),
                                ("syncwatch_job_rerun_steps_total", jv.rerun_steps)):
                    if series.get((name, (("train_job", jv.train_job),))) != v:
                        fail(f"{name} not exported as {v}")
            jk = (gen, jv.train_job, rj.incarnation)
            old = prev_job.get(jk)
            if old is not None and (jv.restarts < old[0] or jv.rerun_steps < old[1]):
                fail(f"{jv.train_job}: job counters went down {old} -> {(jv.restarts, jv.rerun_steps)}")
            prev_job[jk] = (jv.restarts, jv.rerun_steps)

    def deliver(m):
        stats["records"] += 1
        want = ref.apply(m, now[0])
        got = detail = None
        try:
            state.apply(dec.decode(m.data))
        except ProtocolError as e:
            got, detail = e.reason, str(e)
            if e.reason not in COUNTED_HERE:
                state.reject(e.reason)
        if got != want:
            fail(f"record {m.kind} {m.job} rank {m.rank} pid {m.pid} attempt {m.attempt} step "
                 f"{m.step}: daemon {got or 'accepted'}, reference {want or 'accepted'} ({detail})")

    ri = 0
    for m in msgs + [Msg(t_end + 400, "", 0, 0, 0, "tick", b"")]:
        while True:  # housekeeping due before this record
            t_next = min(next_sweep, next_snap, restarts[ri] if ri < len(restarts) else 1e18)
            if t_next > m.t:
                break
            now[0] = t_next
            if ri < len(restarts) and t_next == restarts[ri]:
                check()
                fold(ref)
                ri += 1
                gen += 1
                state, dec, ref = fresh()
                down_until = t_next + sim.rng.uniform(0.5, 10)
            elif t_next == next_sweep:
                state.expire()
                ref.expire(now[0])
                next_sweep += SWEEP_EVERY
            else:
                check()
                next_snap += sim.rng.uniform(5, 30)
        now[0] = m.t
        if m.kind == "tick":
            break
        if m.lost or m.t < down_until:
            stats["lost"] += 1
            continue
        deliver(m)
        if (m.kind == "step" and not m.resend and m.rank != 0 and m.totals.steps > 1
                and sim.rng.random() < 0.01):
            # the same process saying it did fewer steps at a later step: bad_value if the
            # daemon holds a count for it
            t = replace(m.totals, steps=m.totals.steps - 2)
            deliver(Msg(m.t, m.job, m.rank, m.pid, m.attempt, "step",
                        _reencode(dec, m, t), step=m.step + 1, wall=m.wall + 0.001, totals=t))
    check()
    fold(ref)
    stats["cov"] = cov
    return stats


def _reencode(dec, m, totals):
    rec = dec.decode(m.data)
    enc = Encoder(rec.identity)
    return enc.step(rec.step + 1, rec.wall_time + 0.001, rec.step_seconds, rec.wait_seconds,
                    rec.phase_seconds, rec.collective_sequence, rec.samples, rec.tokens, totals,
                    exact=rec.exact, has_tokens=rec.has_tokens, skew=rec.skew)


def main(argv):
    n = int(argv[1]) if len(argv) > 1 else 500
    start = int(argv[2]) if len(argv) > 2 else 0
    total = {"records": 0, "snapshots": 0, "daemon_restarts": 0, "lost": 0}
    cov = {}
    bad = {}
    for seed in range(start, start + n):
        try:
            s = run(seed)
        except Violation as e:
            key = str(e).split(": ", 1)[1].split(" ")[0:3]
            bad.setdefault(" ".join(key), []).append(str(e))
            continue
        for k in total:
            total[k] += s[k]
        for k, v in s["cov"].items():
            cov[k] = cov.get(k, 0) + v
    print(f"{n} histories, {n - sum(map(len, bad.values()))} clean: {total}")
    print("coverage:", dict(sorted(cov.items())))
    for k, v in bad.items():
        print(f"{len(v)} x {k}\n   first: {v[0][:600]}")


if __name__ == "__main__":
    main(sys.argv)
