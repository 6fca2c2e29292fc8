"""Wire protocol between training ranks and the node daemon.

One datagram is one record. Records are binary (``struct``), little-endian, versioned:

    header    "SW" | version u8 | kind u8 | identity length u16
    identity  rank i32 | local_rank i32 | world_size i32 | attempt i32 | gpu i32 | pid u32
              | nonce u32 | train_job, node, gpu_uuid (each: length u8 + UTF-8 bytes)
    body      fixed layout per kind (STEP, HEARTBEAT, END), see the ``*_BODY`` structs

Why binary: a rank sends one record per step, and ``json.dumps`` of a small dict alone costs
~2.5 us where ``struct.pack`` costs ~0.1 us; the daemon decodes 100 k records/s on one core.
The identity block is encoded once per sender and prefixed to every record, and the daemon
caches its decoded form keyed by its bytes, so the per-record cost is the fixed-size body.

A step record carries the step's own values *and* the rank's cumulative counters, so a lost
datagram or a daemon restart loses no totals. Step records and heartbeats also carry the drop and
internal-error counts of the last record the rank's sender delivered before them (``reported_*``):
a daemon that meets the rank's process for the first time (it restarted, or let the rank expire)
counts only what goes beyond those, which an earlier daemon already counted.

The daemon decodes the current version and the one before it (``OLD_VERSION``), so that a node's
daemon can be upgraded first while the ranks of running jobs still speak the earlier release; a
rank on a newer release than its daemon is rejected (``unknown_version``): upgrade daemons first.

A rank's process is its (pid, nonce): the nonce is drawn at random by each ``init()``, whose
counters start from 0, because a pid alone does not tell a restart from the process before it
where the new one gets the same pid (a container restarted in place: a new PID namespace hands
out the same pids again), nor a second ``init()`` in one process from the first.

Every field is validated; anything the daemon cannot account for (bad magic, unknown version or
kind, trailing bytes = unknown fields, out-of-range values, label values outside ``LABEL_RE``) is
rejected with a reason from ``REJECT_REASONS``.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

MAGIC = b"SW"
VERSION = 4  # 2: the reported_dropped and reported_errors fields; 3: the eval phase; 4: the nonce
OLD_VERSION = 3  # still decoded (its identities have no nonce: read as 0): ranks on an earlier
# release keep reporting while their node's daemon is upgraded under them
MAX_DATAGRAM = 2048

KIND_STEP = 1
KIND_HEARTBEAT = 2
KIND_END = 3

PHASES = ("data", "forward", "backward", "optimizer", "sync", "checkpoint", "other", "eval")
PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}
# Planned pauses: a checkpoint save and an evaluation stop training on purpose, often for
# minutes every few hundred steps. They are no jitter (left out of the step times whose variance
# is watched) and no stall (a rank in one is granted time before the job reads stalled).
PAUSES = ("checkpoint", "eval")

END_REASONS = ("completed", "failed", "interrupted")

# Barrier-skew histogram carried (cumulatively) by global rank 0. Fixed by the protocol version.
SKEW_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

FLAG_EXACT = 1  # slack / last-arrival counters come from the exact skew exchange
FLAG_SKEW = 2   # the record carries the job's skew histogram (global rank 0 only)
FLAG_TOKENS = 4  # the rank reports tokens as well as samples

# Limits: a value outside these is "absurd" and its record is rejected.
MAX_SECONDS = 1e6          # one duration (step, phase, wait): ~11.6 days
MAX_TOTAL = 1e15           # any cumulative counter
MAX_WORLD = 1 << 20
MAX_LOCAL_RANK = 4096
MAX_GPU = 1024
MAX_ATTEMPT = 1 << 20
MAX_STEP = 1 << 53
MIN_WALL, MAX_WALL = 1e9, 1e10  # 2001 .. 2286
LABEL_MAX = 128  # characters of a label value
LABEL_RE = re.compile(rf"[A-Za-z0-9_.:@/+=-]{{1,{LABEL_MAX}}}")

REJECT_REASONS = ("too_large", "truncated", "bad_magic", "unknown_version", "unknown_kind",
                  "unknown_fields", "bad_identity", "bad_value", "rank_limit", "job_limit",
                  "identity_conflict")

HEADER = struct.Struct("<2sBBH")
IDENT_FIXED = struct.Struct("<iiiiiII")
_OLD_IDENT_FIXED = struct.Struct("<iiiiiI")  # version 3's: no nonce
_NPH = len(PHASES)


STEP_BODY = struct.Struct(
    "<qddd" + "d" * _NPH      # step, wall_time, step_seconds, wait_seconds, phases (this step)
    + "qdd"                   # collective_sequence, samples, tokens (this step)
    + "qd" + "d" * _NPH       # cumulative: steps, step seconds, phase seconds
    + "dqddqqq"               # slack s, last arrivals, samples, tokens, checkpoints, dropped, errors
    + "qqB")                  # reported dropped, reported errors, flags
SKEW_BODY = struct.Struct("<qd" + "q" * len(SKEW_BUCKETS))  # count, sum, cumulative bucket counts
# wall, last_step, last_step_wall, phase, elapsed, seq, dropped, errors, reported dropped, reported errors
HEARTBEAT_BODY = struct.Struct("<dqdBdqqqqq")
END_BODY = struct.Struct("<dqB")  # wall, last_step, reason


class ProtocolError(ValueError):
    """A record the daemon must reject; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Identity:
    train_job: str
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    node: str
    pid: int
    gpu: int = -1          # -1: unknown / no GPU
    gpu_uuid: str = ""     # "": unknown
    nonce: int = 0         # drawn at each init() (0: a version 3 rank's)

    @property
    def process(self) -> tuple[int, int]:
        """What tells this rank's process (its counters) from another with the same pid."""
        return self.pid, self.nonce

    def encode(self) -> bytes:
        """The identity block, validated. Raises ``ProtocolError`` on a value the daemon would reject."""
        _check_identity(self)
        parts = [IDENT_FIXED.pack(self.rank, self.local_rank, self.world_size, self.attempt,
                                  self.gpu, self.pid, self.nonce)]
        for s in (self.train_job, self.node, self.gpu_uuid):
            b = s.encode()
            parts.append(bytes((len(b),)) + b)
        return b"".join(parts)


@dataclass(slots=True)
class Cumulative:
    """A rank's counters since its process started (reset only by a new process)."""
    steps: int = 0
    step_seconds: float = 0.0
    phase_seconds: tuple[float, ...] = (0.0,) * _NPH
    slack_seconds: float = 0.0
    last_arrivals: int = 0
    samples: float = 0.0
    tokens: float = 0.0
    checkpoints: int = 0
    dropped_records: int = 0
    internal_errors: int = 0
    # the dropped_records and internal_errors of the last record delivered before this one
    reported_dropped: int = 0
    reported_errors: int = 0


@dataclass(slots=True)
class SkewHistogram:
    """Cumulative histogram of per-step barrier skew, kept by global rank 0."""
    count: int = 0
    sum: float = 0.0
    buckets: tuple[int, ...] = (0,) * len(SKEW_BUCKETS)  # cumulative counts per SKEW_BUCKETS bound


@dataclass(slots=True)
class StepRecord:
    identity: Identity
    step: int
    wall_time: float
    step_seconds: float
    wait_seconds: float
    phase_seconds: tuple[float, ...]
    collective_sequence: int
    samples: float
    tokens: float
    totals: Cumulative
    exact: bool = False
    has_tokens: bool = False
    skew: SkewHistogram | None = None


@dataclass(slots=True)
class HeartbeatRecord:
    identity: Identity
    wall_time: float
    last_step: int
    last_step_wall_time: float  # 0 until the first step completes
    phase: str
    phase_elapsed: float
    collective_sequence: int
    dropped_records: int
    internal_errors: int
    reported_dropped: int = 0
    reported_errors: int = 0


@dataclass(slots=True)
class EndRecord:
    identity: Identity
    wall_time: float
    last_step: int
    reason: str


Record = StepRecord | HeartbeatRecord | EndRecord


def _header(kind: int, ident: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(ident)) + ident


class Encoder:
    """Encodes records for one rank. The identity block is built (and validated) once."""

    __slots__ = ("identity", "_step_prefix", "_hb_prefix", "_end_prefix")

    def __init__(self, identity: Identity):
        self.identity = identity
        ident = identity.encode()
        self._step_prefix = _header(KIND_STEP, ident)
        self._hb_prefix = _header(KIND_HEARTBEAT, ident)
        self._end_prefix = _header(KIND_END, ident)

    def step(self, step: int, wall_time: float, step_seconds: float, wait_seconds: float,
             phase_seconds, collective_sequence: int, samples: float, tokens: float,
             totals: Cumulative, exact: bool = False, has_tokens: bool = False,
             skew: SkewHistogram | None = None) -> bytes:
        flags = (FLAG_EXACT if exact else 0) | (FLAG_TOKENS if has_tokens else 0)
        tail = b""
        if skew is not None:
            flags |= FLAG_SKEW
            tail = SKEW_BODY.pack(skew.count, skew.sum, *skew.buckets)
        t = totals
        return self._step_prefix + STEP_BODY.pack(
            step, wall_time, step_seconds, wait_seconds, *phase_seconds,
            collective_sequence, samples, tokens,
            t.steps, t.step_seconds, *t.phase_seconds, t.slack_seconds, t.last_arrivals,
            t.samples, t.tokens, t.checkpoints, t.dropped_records, t.internal_errors,
            t.reported_dropped, t.reported_errors, flags) + tail

    def heartbeat(self, wall_time: float, last_step: int, last_step_wall_time: float, phase: str,
                  phase_elapsed: float, collective_sequence: int, dropped_records: int = 0,
                  internal_errors: int = 0, reported_dropped: int = 0,
                  reported_errors: int = 0) -> bytes:
        return self._hb_prefix + HEARTBEAT_BODY.pack(
            wall_time, last_step, last_step_wall_time, PHASE_INDEX[phase], phase_elapsed,
            collective_sequence, dropped_records, internal_errors, reported_dropped,
            reported_errors)

    def end(self, wall_time: float, last_step: int, reason: str = "completed") -> bytes:
        return self._end_prefix + END_BODY.pack(wall_time, last_step, END_REASONS.index(reason))


# ---------------------------------------------------------------------------------------------
# Decoding and validation


def _check_identity(i: Identity) -> None:
    if not (1 <= i.world_size <= MAX_WORLD and 0 <= i.rank < i.world_size
            and 0 <= i.local_rank < MAX_LOCAL_RANK and 0 <= i.attempt < MAX_ATTEMPT
            and -1 <= i.gpu < MAX_GPU and 0 < i.pid < 1 << 32 and 0 <= i.nonce < 1 << 32):
        raise ProtocolError("bad_identity", _first_failed((
            (1 <= i.world_size <= MAX_WORLD, f"world_size {i.world_size} is not within 1..2**20"),
            (0 <= i.rank < i.world_size, f"rank {i.rank} is not within 0..world_size - 1"),
            (0 <= i.local_rank < MAX_LOCAL_RANK,
             f"local_rank {i.local_rank} is not within 0..{MAX_LOCAL_RANK - 1}"),
            (0 <= i.attempt < MAX_ATTEMPT, f"attempt {i.attempt} is not within 0..2**20 - 1"),
            (-1 <= i.gpu < MAX_GPU, f"gpu {i.gpu} is not within -1..{MAX_GPU - 1}"),
            (0 < i.pid < 1 << 32, f"pid {i.pid} is not within 1..2**32 - 1"),
            (0 <= i.nonce < 1 << 32, f"nonce {i.nonce} is not within 0..2**32 - 1"),
        )) + f" in {i!r}")
    for name, value in (("train_job", i.train_job), ("node", i.node)):
        if not LABEL_RE.fullmatch(value):
            raise ProtocolError("bad_identity", f"{name} {value[:40]!r} is not 1-128 of [A-Za-z0-9_.:@/+=-]")
    if i.gpu_uuid and not LABEL_RE.fullmatch(i.gpu_uuid):
        raise ProtocolError("bad_identity", f"gpu_uuid {i.gpu_uuid[:40]!r} is not a valid label value")


def decode_identity(block: bytes, version: int = VERSION) -> Identity:
    fixed = IDENT_FIXED if version == VERSION else _OLD_IDENT_FIXED
    if len(block) < fixed.size:
        raise ProtocolError("truncated", "identity block too short")
    rank, local_rank, world, attempt, gpu, pid, *nonce = fixed.unpack_from(block)
    pos = fixed.size
    strings = []
    for name in ("train_job", "node", "gpu_uuid"):
        if pos >= len(block):
            raise ProtocolError("truncated", "identity strings cut short")
        n = block[pos]
        raw = block[pos + 1:pos + 1 + n]
        if len(raw) != n:
            raise ProtocolError("truncated", "identity strings cut short")
        try:
            strings.append(raw.decode())
        except UnicodeDecodeError:
            raise ProtocolError("bad_identity", f"{name} {raw[:40]!r} is not UTF-8") from None
        pos += 1 + n
    if pos != len(block):
        raise ProtocolError("unknown_fields", f"{len(block) - pos} unknown bytes in identity block")
    ident = Identity(train_job=strings[0], attempt=attempt, rank=rank, local_rank=local_rank,
                     world_size=world, node=strings[1], pid=pid, gpu=gpu, gpu_uuid=strings[2],
                     nonce=nonce[0] if nonce else 0)
    _check_identity(ident)
    return ident


# the names of the values _check_floats is given, for its reject message
_DURATIONS = ("step_seconds", "wait_seconds", *(f"{p} phase seconds" for p in PHASES))
_COUNTERS = ("samples", "tokens", "step_seconds_total", *(f"{p} phase seconds total" for p in PHASES),
             "slack_seconds_total", "samples_total", "tokens_total")


def _check_floats(values, limit: float, names) -> None:
    # sum() is NaN or inf if any element is; min/max then bound the finite ones.
    if not math.isfinite(sum(values)) or min(values) < 0.0 or max(values) > limit:
        name, value = next((n, v) for n, v in zip(names, values) if not 0.0 <= v <= limit)
        raise ProtocolError("bad_value", f"{name} {value!r} is not within 0..{limit:g}")


def _first_failed(checks) -> str:
    """The description of the first failed check of ``(passed, description)`` pairs."""
    return next(what for passed, what in checks if not passed)


def _sender(ident: Identity) -> str:
    return f"train job {ident.train_job!r} rank {ident.rank} pid {ident.pid} on {ident.node}"


def _count_checks(dropped: int, errors: int, rep_dropped: int, rep_errors: int) -> tuple:
    return ((0 <= dropped <= MAX_STEP, f"dropped_records {dropped} is not within 0..2**53"),
            (0 <= rep_dropped <= dropped,
             f"reported_dropped {rep_dropped} is not within 0..dropped_records {dropped}"),
            (0 <= errors <= MAX_STEP, f"internal_errors {errors} is not within 0..2**53"),
            (0 <= rep_errors <= errors,
             f"reported_errors {rep_errors} is not within 0..internal_errors {errors}"))


class Decoder:
    """Decodes and validates datagrams. Decoded identities are cached by their bytes (bounded),
    one cache per version: a block's bytes read as another version's are another identity."""

    def __init__(self, identity_cache_size: int = 8192):
        self._identities: dict[int, dict[bytes, Identity]] = {VERSION: {}, OLD_VERSION: {}}
        self._cache_size = identity_cache_size

    def _identity(self, block: bytes, version: int) -> Identity:
        cache = self._identities[version]
        ident = cache.get(block)
        if ident is None:
            ident = decode_identity(block, version)
            if len(cache) >= self._cache_size:
                cache.clear()
            cache[block] = ident
        return ident

    def decode(self, data: bytes) -> Record:
        """Return the record in ``data`` or raise ``ProtocolError`` with the reason."""
        n = len(data)
        if n > MAX_DATAGRAM:
            # the daemon reads one byte more than the limit: n says nothing of the real size
            raise ProtocolError("too_large", f"more than {MAX_DATAGRAM} bytes")
        if n < HEADER.size:
            raise ProtocolError("truncated", f"{n} bytes is shorter than the header")
        magic, version, kind, ident_len = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise ProtocolError("bad_magic")
        if version != VERSION and version != OLD_VERSION:
            raise ProtocolError("unknown_version", f"version {version}, this daemon speaks "
                                                   f"{OLD_VERSION} and {VERSION}")
        body_at = HEADER.size + ident_len
        if body_at > n:
            raise ProtocolError("truncated", "identity block cut short")
        ident = self._identity(bytes(data[HEADER.size:body_at]), version)
        try:
            if kind == KIND_STEP:
                return self._step(ident, data, body_at)
            if kind == KIND_HEARTBEAT:
                return self._heartbeat(ident, data, body_at)
            if kind == KIND_END:
                return self._end(ident, data, body_at)
            raise ProtocolError("unknown_kind", f"kind {kind}")
        except ProtocolError as e:  # the identity is valid: say who sent the record
            raise ProtocolError(e.reason, f"{e.detail} (from {_sender(ident)})") from None

    @staticmethod
    def _fixed(body: struct.Struct, data: bytes, at: int, extra: int = 0) -> tuple:
        end = at + body.size
        if len(data) < end + extra:
            raise ProtocolError("truncated", "record body cut short")
        if len(data) > end + extra:
            raise ProtocolError("unknown_fields", f"{len(data) - end - extra} unknown trailing bytes")
        return body.unpack_from(data, at)

    def _step(self, ident: Identity, data: bytes, at: int) -> StepRecord:
        if len(data) <= at + STEP_BODY.size - 1:
            raise ProtocolError("truncated", "record body cut short")
        flags = data[at + STEP_BODY.size - 1]
        if flags & ~(FLAG_EXACT | FLAG_SKEW | FLAG_TOKENS):
            raise ProtocolError("unknown_fields", f"unknown flag bits {flags:#x}")
        extra = SKEW_BODY.size if flags & FLAG_SKEW else 0
        v = self._fixed(STEP_BODY, data, at, extra)
        step, wall, step_s, wait_s = v[0], v[1], v[2], v[3]
        phases = v[4:4 + _NPH]
        seq, samples, tokens = v[4 + _NPH:7 + _NPH]
        c = v[7 + _NPH:]
        steps_total, step_s_total = c[0], c[1]
        phase_totals = c[2:2 + _NPH]
        (slack, last_arr, samples_total, tokens_total, ckpts, dropped, errors, rep_dropped,
         rep_errors) = c[2 + _NPH:11 + _NPH]
        if not MIN_WALL <= wall <= MAX_WALL:
            raise ProtocolError("bad_value", f"wall_time {wall!r} is not a plausible unix time")
        _check_floats((step_s, wait_s, *phases), MAX_SECONDS, _DURATIONS)
        _check_floats((samples, tokens, step_s_total, *phase_totals, slack, samples_total,
                       tokens_total), MAX_TOTAL, _COUNTERS)
        if not (0 <= step <= MAX_STEP and 0 <= seq <= MAX_STEP and 0 <= steps_total <= MAX_STEP
                and 0 <= last_arr <= steps_total and 0 <= ckpts <= MAX_STEP
                and 0 <= rep_dropped <= dropped <= MAX_STEP
                and 0 <= rep_errors <= errors <= MAX_STEP):
            raise ProtocolError("bad_value", _first_failed((
                (0 <= step <= MAX_STEP, f"step {step} is not within 0..2**53"),
                (0 <= seq <= MAX_STEP, f"collective_sequence {seq} is not within 0..2**53"),
                (0 <= steps_total <= MAX_STEP, f"steps_total {steps_total} is not within 0..2**53"),
                (0 <= last_arr <= steps_total,
                 f"last_arrivals {last_arr} is not within 0..steps_total {steps_total}"),
                (0 <= ckpts <= MAX_STEP, f"checkpoints {ckpts} is not within 0..2**53"),
                *_count_checks(dropped, errors, rep_dropped, rep_errors))))
        skew = None
        if extra:
            sv = SKEW_BODY.unpack_from(data, at + STEP_BODY.size)
            count, ssum, buckets = sv[0], sv[1], sv[2:]
            _check_floats((ssum,), MAX_TOTAL, ("skew histogram sum",))
            if count < 0 or any(b < 0 for b in buckets) or any(
                    a > b for a, b in zip(buckets, buckets[1:] + (count,))):
                raise ProtocolError("bad_value", "skew histogram buckets are not cumulative")
            skew = SkewHistogram(count, ssum, buckets)
        totals = Cumulative(steps_total, step_s_total, phase_totals, slack, last_arr,
                            samples_total, tokens_total, ckpts, dropped, errors, rep_dropped,
                            rep_errors)
        return StepRecord(ident, step, wall, step_s, wait_s, phases, seq, samples, tokens, totals,
                          bool(flags & FLAG_EXACT), bool(flags & FLAG_TOKENS), skew)

    def _heartbeat(self, ident: Identity, data: bytes, at: int) -> HeartbeatRecord:
        (wall, last_step, last_wall, phase, elapsed, seq, dropped, errors, rep_dropped,
         rep_errors) = self._fixed(HEARTBEAT_BODY, data, at)
        if not MIN_WALL <= wall <= MAX_WALL:
            raise ProtocolError("bad_value", f"wall_time {wall!r} is not a plausible unix time")
        if not (last_wall == 0 or MIN_WALL <= last_wall <= MAX_WALL):
            raise ProtocolError("bad_value", f"last_step_wall_time {last_wall!r} is neither 0 nor "
                                             f"a plausible unix time")
        if phase >= _NPH:
            raise ProtocolError("bad_value", f"phase code {phase} (0..{_NPH - 1})")
        _check_floats((elapsed,), MAX_SECONDS, ("phase_elapsed",))
        if not (0 <= last_step <= MAX_STEP and 0 <= seq <= MAX_STEP
                and 0 <= rep_dropped <= dropped <= MAX_STEP
                and 0 <= rep_errors <= errors <= MAX_STEP):
            raise ProtocolError("bad_value", _first_failed((
                (0 <= last_step <= MAX_STEP, f"last_step {last_step} is not within 0..2**53"),
                (0 <= seq <= MAX_STEP, f"collective_sequence {seq} is not within 0..2**53"),
                *_count_checks(dropped, errors, rep_dropped, rep_errors))))
        return HeartbeatRecord(ident, wall, last_step, last_wall, PHASES[phase], elapsed, seq,
                               dropped, errors, rep_dropped, rep_errors)

    def _end(self, ident: Identity, data: bytes, at: int) -> EndRecord:
        wall, last_step, reason = self._fixed(END_BODY, data, at)
        if not MIN_WALL <= wall <= MAX_WALL:
            raise ProtocolError("bad_value", f"wall_time {wall!r} is not a plausible unix time")
        if reason >= len(END_REASONS):
            raise ProtocolError("bad_value", f"end reason code {reason} (0..{len(END_REASONS) - 1})")
        if not 0 <= last_step <= MAX_STEP:
            raise ProtocolError("bad_value", f"last_step {last_step} is not within 0..2**53")
        return EndRecord(ident, wall, last_step, END_REASONS[reason])
