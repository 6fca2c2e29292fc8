"""Wire protocol: round trips and every reject reason."""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest

from syncwatch.protocol import (HEADER, IDENT_FIXED, MAX_DATAGRAM, PHASES, REJECT_REASONS,
                                SKEW_BUCKETS, VERSION, Cumulative, Decoder, EndRecord, Encoder,
                                HeartbeatRecord, Identity, ProtocolError, SkewHistogram, StepRecord)

IDENT = Identity(train_job="llama-7b.run:3", attempt=2, rank=5, local_rank=1, world_size=16,
                 node="gpu-node-07", pid=4242, gpu=1, gpu_uuid="GPU-8f1c2d3e-aaaa",
                 nonce=0xDEADBEEF)
TOTALS = Cumulative(steps=10, step_seconds=1.5, phase_seconds=tuple(0.1 * i for i in range(len(PHASES))),
                    slack_seconds=0.25, last_arrivals=3, samples=320.0, tokens=32000.0,
                    checkpoints=1, dropped_records=4, internal_errors=2, reported_dropped=3,
                    reported_errors=2)
WALL = 1_800_000_000.5


def step_bytes(enc=None, **kw) -> bytes:
    args = dict(step=10, wall_time=WALL, step_seconds=0.15, wait_seconds=0.01,
                phase_seconds=tuple(0.01 * i for i in range(len(PHASES))), collective_sequence=20,
                samples=32.0, tokens=3200.0, totals=TOTALS, exact=True, has_tokens=True)
    args.update(kw)
    return (enc or Encoder(IDENT)).step(**args)


def reason_of(data: bytes) -> str:
    with pytest.raises(ProtocolError) as e:
        Decoder().decode(data)
    assert e.value.reason in REJECT_REASONS
    return e.value.reason


def test_step_round_trip_with_skew():
    skew = SkewHistogram(count=7, sum=0.02, buckets=tuple(min(i, 7) for i in range(len(SKEW_BUCKETS))))
    rec = Decoder().decode(step_bytes(skew=skew))
    assert isinstance(rec, StepRecord)
    assert rec.identity == IDENT
    assert (rec.step, rec.wall_time, rec.step_seconds, rec.wait_seconds) == (10, WALL, 0.15, 0.01)
    assert rec.phase_seconds == tuple(0.01 * i for i in range(len(PHASES)))
    assert (rec.collective_sequence, rec.samples, rec.tokens) == (20, 32.0, 3200.0)
    assert rec.totals == TOTALS
    assert rec.exact and rec.has_tokens
    assert rec.skew == skew


def test_heartbeat_and_end_round_trip():
    enc = Encoder(IDENT)
    hb = Decoder().decode(enc.heartbeat(WALL, 9, WALL - 3, "sync", 2.5, 19, 4, 1, 3, 0))
    assert hb == HeartbeatRecord(IDENT, WALL, 9, WALL - 3, "sync", 2.5, 19, 4, 1, 3, 0)
    for name in PHASES:
        assert Decoder().decode(enc.heartbeat(WALL, 9, WALL - 3, name, 60.0, 19)).phase == name
    end = Decoder().decode(enc.end(WALL, 10, "failed"))
    assert end == EndRecord(IDENT, WALL, 10, "failed")


def test_decoder_caches_identity_objects():
    d = Decoder()
    a, b = d.decode(step_bytes()), d.decode(step_bytes(step=11))
    assert a.identity is b.identity


def test_too_large():
    assert reason_of(step_bytes() + b"\0" * MAX_DATAGRAM) == "too_large"


@pytest.mark.parametrize("cut", [0, 1, 5, HEADER.size + 3, -1, -40])
def test_truncated(cut):
    data = step_bytes()
    assert reason_of(data[:cut]) == "truncated"


def test_bad_magic_unknown_version_unknown_kind():
    data = step_bytes()
    assert reason_of(b"XY" + data[2:]) == "bad_magic"
    for version in (VERSION - 2, VERSION + 1):  # 2 is the layout before the eval phase
        assert reason_of(data[:2] + bytes([version]) + data[3:]) == "unknown_version"
    assert reason_of(data[:3] + bytes([99]) + data[4:]) == "unknown_kind"


def test_version_3_records_decode_with_nonce_0():
    """A rank on the release before the nonce keeps reporting to an upgraded daemon: its identity
    block (written here in version 3's layout, independent of the encoder) has no nonce, read as
    0; the bodies are the same. A block's bytes read as the other version are rejected."""
    fixed = struct.pack("<iiiiiI", 5, 1, 16, 2, 1, 4242)
    ident = fixed + b"".join(bytes((len(s),)) + s for s in (b"llama-7b.run:3", b"gpu-node-07",
                                                           b"GPU-8f1c2d3e-aaaa"))
    body = step_bytes()[HEADER.size + len(IDENT.encode()):]
    rec = Decoder().decode(HEADER.pack(b"SW", 3, 1, len(ident)) + ident + body)
    assert rec.identity == dataclasses.replace(IDENT, nonce=0)
    assert rec.identity.process == (4242, 0)
    assert (rec.step, rec.totals) == (10, TOTALS)
    hb = Encoder(IDENT).heartbeat(WALL, 9, WALL - 3, "eval", 2.5, 19)[HEADER.size + len(IDENT.encode()):]
    assert Decoder().decode(HEADER.pack(b"SW", 3, 2, len(ident)) + ident + hb).phase == "eval"
    assert reason_of(HEADER.pack(b"SW", 4, 1, len(ident)) + ident + body) == "truncated"
    v4 = IDENT.encode()
    assert reason_of(HEADER.pack(b"SW", 3, 1, len(v4)) + v4 + body) == "truncated"


def test_the_nonce_tells_processes_with_one_pid_apart():
    d = Decoder()
    a = d.decode(step_bytes())
    b = d.decode(step_bytes(Encoder(dataclasses.replace(IDENT, nonce=7))))
    assert (a.identity.pid, b.identity.pid) == (4242, 4242)
    assert a.identity.process != b.identity.process
    for nonce in (-1, 1 << 32):
        with pytest.raises(ProtocolError):
            Encoder(dataclasses.replace(IDENT, nonce=nonce))


def test_unknown_fields():
    ident = IDENT.encode() + b"\0"  # a byte after the identity block's strings
    body = step_bytes()[HEADER.size + len(IDENT.encode()):]
    assert reason_of(HEADER.pack(b"SW", VERSION, 1, len(ident)) + ident + body) == "unknown_fields"
    data = step_bytes()
    assert reason_of(data + b"\x01") == "unknown_fields"
    flags_at = len(data) - 1
    assert reason_of(data[:flags_at] + bytes([data[flags_at] | 0x80])) == "unknown_fields"
    hb = Encoder(IDENT).heartbeat(WALL, 1, WALL, "data", 0.1, 1)
    assert reason_of(hb + b"\0\0") == "unknown_fields"


def _with_identity(fixed: tuple, strings=(b"job", b"node", b"")) -> bytes:
    ident = IDENT_FIXED.pack(*fixed) + b"".join(bytes((len(s),)) + s for s in strings)
    body = step_bytes()[HEADER.size + len(IDENT.encode()):]
    return HEADER.pack(b"SW", VERSION, 1, len(ident)) + ident + body


@pytest.mark.parametrize("fixed,strings", [
    ((4, 0, 4, 0, -1, 1, 9), (b"job", b"node", b"")),         # rank == world
    ((-1, 0, 4, 0, -1, 1, 9), (b"job", b"node", b"")),        # negative rank
    ((0, 0, 4, 0, -1, 0, 9), (b"job", b"node", b"")),         # pid 0
    ((0, 0, 4, 0, -2, 1, 9), (b"job", b"node", b"")),         # gpu -2
    ((0, 0, 4, 0, -1, 1, 9), (b"job name", b"node", b"")),    # space in a label value
    ((0, 0, 4, 0, -1, 1, 9), (b'job"}', b"node", b"")),       # exposition injection attempt
    ((0, 0, 4, 0, -1, 1, 9), (b"", b"node", b"")),            # empty job
    ((0, 0, 4, 0, -1, 1, 9), (b"j" * 129, b"node", b"")),     # longer than 128
    ((0, 0, 4, 0, -1, 1, 9), (b"job", b"\xff\xfe", b"")),     # not UTF-8
    ((0, 0, 4, 0, -1, 1, 9), (b"job", b"n\xc3\xa9", b"")),    # UTF-8 but outside the label set
    ((0, 0, 4, 0, -1, 1, 9), (b"job", b"node", b"GPU 1")),    # a gpu_uuid outside it
])
def test_bad_identity(fixed, strings):
    assert reason_of(_with_identity(fixed, strings)) == "bad_identity"


@pytest.mark.parametrize("fixed,strings,message", [
    ((4, 0, 4, 0, -1, 1, 9), (b"job", b"node", b""), "rank 4 is not within 0..world_size - 1"),
    ((0, 0, 0, 0, -1, 1, 9), (b"job", b"node", b""), "world_size 0 is not within 1..2**20"),
    ((0, 5000, 4, 0, -1, 1, 9), (b"job", b"node", b""), "local_rank 5000 is not within 0..4095"),
    ((0, 0, 4, -2, -1, 1, 9), (b"job", b"node", b""), "attempt -2 is not within 0..2**20 - 1"),
    ((0, 0, 4, 0, -2, 1, 9), (b"job", b"node", b""), "gpu -2 is not within -1..1023"),
    ((0, 0, 4, 0, -1, 0, 9), (b"job", b"node", b""), "pid 0 is not within 1..2**32 - 1"),
    ((0, 0, 4, 0, -1, 1, 9), (b"job", b"\xff\xfe", b""), "node b'\\xff\\xfe' is not UTF-8"),
    ((0, 0, 4, 0, -1, 1, 9), (b"job", b"node", b"GPU-\xc3"), "gpu_uuid b'GPU-\\xc3' is not UTF-8"),
])
def test_a_bad_identity_names_its_field(fixed, strings, message):
    """Its log line said "numbers out of range: Identity(...)" or "label value is not UTF-8":
    which of the numbers, or of the three labels, was left to guess."""
    with pytest.raises(ProtocolError) as e:
        Decoder().decode(_with_identity(fixed, strings))
    assert e.value.reason == "bad_identity"
    assert e.value.detail.startswith(message), e.value.detail


def test_valid_crafted_identity_decodes():
    rec = Decoder().decode(_with_identity((0, 0, 4, 0, -1, 1, 9), (b"j" * 128, b"node", b"")))
    assert rec.identity.train_job == "j" * 128


def test_identity_encode_refuses_bad_labels():
    with pytest.raises(ProtocolError):
        Encoder(Identity("bad job", 0, 0, 0, 1, "n", 1))


@pytest.mark.parametrize("kw", [
    dict(step_seconds=float("nan")), dict(wait_seconds=float("inf")), dict(step_seconds=-0.1),
    dict(step_seconds=2e6), dict(wall_time=0.0), dict(wall_time=float("nan")),
    dict(phase_seconds=(0.1,) * (len(PHASES) - 1) + (float("nan"),)), dict(samples=-1.0), dict(step=-5),
    dict(collective_sequence=-1),
    dict(totals=Cumulative(steps=2, last_arrivals=3)),          # more last arrivals than steps
    dict(totals=Cumulative(steps=1, samples=float("inf"))),
    dict(totals=Cumulative(steps=1, dropped_records=-1)),
    dict(totals=Cumulative(steps=1, dropped_records=2, reported_dropped=3)),  # more than dropped
    dict(totals=Cumulative(steps=1, internal_errors=1, reported_errors=-1)),
    dict(totals=Cumulative(steps=1, step_seconds=1e16)),
    dict(totals=Cumulative(steps=1, dropped_records=2**63 - 1)),  # counts past MAX_STEP: they
    dict(totals=Cumulative(steps=1, internal_errors=2**62)),      # would poison the daemon's
    dict(totals=Cumulative(steps=1, checkpoints=2**62)),          # totals until it restarts
    dict(skew=SkewHistogram(3, 0.1, (5,) * len(SKEW_BUCKETS))),  # bucket above the count
    dict(skew=SkewHistogram(3, 0.1, (2, 1) + (3,) * (len(SKEW_BUCKETS) - 2))),  # not cumulative
    dict(skew=SkewHistogram(3, float("nan"), (3,) * len(SKEW_BUCKETS))),
])
def test_bad_values(kw):
    assert reason_of(step_bytes(**kw)) == "bad_value"


def test_bad_heartbeat_and_end_values():
    enc = Encoder(IDENT)
    assert reason_of(enc.heartbeat(WALL, 1, WALL, "sync", float("nan"), 1)) == "bad_value"
    assert reason_of(enc.heartbeat(WALL, 1, 5.0, "sync", 1.0, 1)) == "bad_value"
    hb = bytearray(enc.heartbeat(WALL, 1, WALL, "sync", 1.0, 1))
    hb[len(hb) - struct.calcsize("<dqqqqq") - 1] = len(PHASES)  # phase code out of range
    assert reason_of(bytes(hb)) == "bad_value"
    assert reason_of(enc.heartbeat(WALL, 1, WALL, "sync", 1.0, 1, 2, 0, 3, 0)) == "bad_value"
    assert reason_of(enc.heartbeat(WALL, 1, WALL, "sync", 1.0, 1, 2, 1, 2, 2)) == "bad_value"
    assert reason_of(enc.heartbeat(WALL, 1, WALL, "sync", 1.0, 1, 2**62, 0)) == "bad_value"
    assert reason_of(enc.heartbeat(WALL, 1, WALL, "sync", 1.0, 1, 0, 2**62)) == "bad_value"
    end = bytearray(enc.end(WALL, 1))
    end[-1] = 9
    assert reason_of(bytes(end)) == "bad_value"
    for wall in (0.0, float("nan")):  # a record's own wall time: not a plausible unix time
        assert reason_of(enc.heartbeat(wall, 1, WALL, "sync", 1.0, 1)) == "bad_value"
        assert reason_of(enc.end(wall, 1)) == "bad_value"


def _end_with(last_step: int) -> bytes:
    end = Encoder(IDENT).end(WALL, 1)
    return end[:-9] + struct.pack("<q", last_step) + end[-1:]


@pytest.mark.parametrize("data, message", [
    # an end record with a bad last step was "end reason 0", its valid reason; no message named
    # the field, nor the rank that sent the record (its identity block is valid by then)
    (_end_with(-5), "last_step -5 is not within 0..2**53"),
    (Encoder(IDENT).end(WALL, 1)[:-1] + b"\x07", "end reason code 7 (0..2)"),
    (step_bytes(wait_seconds=float("inf")), "wait_seconds inf is not within 0..1e+06"),
    (step_bytes(phase_seconds=(0.1,) * (len(PHASES) - 1) + (-1.0,)),
     "eval phase seconds -1.0 is not within 0..1e+06"),
    (step_bytes(samples=-1.0), "samples -1.0 is not within 0..1e+15"),
    (step_bytes(totals=Cumulative(steps=2, last_arrivals=3)),
     "last_arrivals 3 is not within 0..steps_total 2"),
    (step_bytes(totals=Cumulative(steps=1, dropped_records=2, reported_dropped=3)),
     "reported_dropped 3 is not within 0..dropped_records 2"),
    (Encoder(IDENT).heartbeat(WALL, 1, 5.0, "sync", 1.0, 1),
     "last_step_wall_time 5.0 is neither 0 nor a plausible unix time"),
    (Encoder(IDENT).heartbeat(WALL, 1, WALL, "sync", 1.0, -3), "collective_sequence -3 is not within"),
    (step_bytes() + b"\x00", "1 unknown trailing bytes"),
])
def test_a_rejected_record_names_its_field_and_sender(data, message):
    with pytest.raises(ProtocolError) as e:
        Decoder().decode(data)
    assert message in str(e.value)
    assert str(e.value).endswith("(from train job 'llama-7b.run:3' rank 5 pid 4242 on gpu-node-07)")


def test_random_bytes_and_mutations_only_ever_raise_protocol_errors():
    rng = random.Random(2024)
    d = Decoder()
    good = step_bytes(skew=SkewHistogram(1, 0.001, (0,) * 4 + (1,) * 12))
    seen = set()
    for i in range(5000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
            if rng.random() < 0.5:
                data = b"SW\x01" + data
        else:
            b = bytearray(good)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b)
        try:
            rec = d.decode(data)
        except ProtocolError as e:
            assert e.reason in REJECT_REASONS
            seen.add(e.reason)
        else:
            assert isinstance(rec, StepRecord | HeartbeatRecord | EndRecord)
    assert {"bad_magic", "truncated", "bad_value", "unknown_fields"} <= seen
