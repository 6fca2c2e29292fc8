"""Daemon ingest throughput on one core: decode + validate + state update per record.

1. In process: a pre-encoded stream of step records from 64 ranks through ``Decoder.decode`` and
   ``State.apply`` (what the reader thread does per datagram), best of 5 runs.
2. End to end: one process blasts records over the Unix socket with blocking sends into a live
   daemon process; records/s accepted by the daemon.
"""

from __future__ import annotations

import socket
import time

from _common import DaemonProcess, encoder, machine, median, parse_args, step_record

from syncwatch.daemon.config import DaemonConfig
from syncwatch.daemon.state import State
from syncwatch.protocol import Decoder

RANKS, STEPS = 64, 1000


def in_process() -> list[float]:
    encs = [encoder(r) for r in range(RANKS)]
    stream = [step_record(e, s) for s in range(1, STEPS + 1) for e in encs]
    rates = []
    for _ in range(5):
        state, dec = State(DaemonConfig(socket=None)), Decoder()
        decode, apply = dec.decode, state.apply
        t0 = time.perf_counter()
        for data in stream:
            apply(decode(data))
        rates.append(len(stream) / (time.perf_counter() - t0))
        assert state.records == len(stream)
    return rates


def decode_only() -> float:
    encs = [encoder(r) for r in range(RANKS)]
    stream = [step_record(e, s) for s in range(1, 201) for e in encs]
    dec = Decoder()
    t0 = time.perf_counter()
    for data in stream:
        dec.decode(data)
    return len(stream) / (time.perf_counter() - t0)


def end_to_end(n: int = 100_000) -> float:
    d = DaemonProcess()
    try:
        encs = [encoder(r) for r in range(RANKS)]
        stream = [step_record(encs[i % RANKS], i // RANKS + 1) for i in range(n)]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.connect(d.socket)
        t0 = time.perf_counter()
        for data in stream:
            s.send(data)  # blocking: waits while the daemon's queue is full, loses nothing
        while d.healthz()["records"] < n:
            time.sleep(0.005)
        rate = n / (time.perf_counter() - t0)
        return rate
    finally:
        d.stop()


def main() -> None:
    parse_args(__doc__)
    print(f"machine: {machine()}")
    rates = in_process()
    print(f"in process, decode+validate+update, {RANKS} ranks x {STEPS} steps: "
          f"median {median(rates) / 1e3:.0f} k records/s (best {max(rates) / 1e3:.0f} k/s, "
          f"{1e6 / median(rates):.2f} us/record)")
    print(f"decode+validate only: {decode_only() / 1e3:.0f} k records/s")
    e2e = [end_to_end() for _ in range(3)]
    print(f"end to end over the Unix socket into a live daemon process: median "
          f"{median(e2e) / 1e3:.0f} k records/s (runs: {', '.join(f'{r / 1e3:.0f}k' for r in e2e)})")


if __name__ == "__main__":
    main()
