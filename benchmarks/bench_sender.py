"""Sender cost per step record on the training thread: encode + send into a live daemon.

Sends are paced (one every ~0.3 ms, far faster than real steps) so the figure is the cost a
training step pays, not the cost of a saturated queue. Prints medians and tail percentiles.
"""

from __future__ import annotations

import time

from _common import DaemonProcess, encoder, machine, parse_args

from syncwatch.protocol import PHASES, Cumulative
from syncwatch.sender import Sender

N = 20_000


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def measure(sender: Sender, pace: float) -> tuple[list[float], list[float], list[float]]:
    enc = encoder(0)
    totals = Cumulative(1, 0.1, (0.01,) * len(PHASES), 0.0, 0, 32.0, 0.0, 0, 0, 0)
    phases = (0.01,) * len(PHASES)
    enc_us, send_us, both_us = [], [], []
    clock = time.perf_counter_ns
    for step in range(1, N + 1):
        t0 = clock()
        data = enc.step(step, 1.8e9 + step, 0.1, 0.002, phases, step, 32.0, 0.0, totals, exact=True)
        t1 = clock()
        sender.send(data)
        t2 = clock()
        enc_us.append((t1 - t0) / 1e3)
        send_us.append((t2 - t1) / 1e3)
        both_us.append((t2 - t0) / 1e3)
        if pace:
            time.sleep(pace)
    return enc_us, send_us, both_us


def report(name, sender, rows):
    enc_us, send_us, both_us = rows
    print(f"{name:32s} encode p50 {pct(enc_us, 50):5.2f} us | send p50 {pct(send_us, 50):5.2f} "
          f"p99 {pct(send_us, 99):6.2f} us | encode+send p50 {pct(both_us, 50):5.2f} "
          f"p90 {pct(both_us, 90):5.2f} p99 {pct(both_us, 99):6.2f} max {max(both_us):7.1f} us | "
          f"sent {sender.sent} dropped {sender.dropped}")


def main() -> None:
    parse_args(__doc__)
    print(f"machine: {machine()}; {N} step records per case")
    d = DaemonProcess(udp=True)
    try:
        time.sleep(0.5)
        s = Sender(d.socket)
        report("unix socket, live daemon", s, measure(s, 0.0003))
        s.flush(5)
        u = Sender(udp=d.udp)
        report("udp loopback, live daemon", u, measure(u, 0.0003))
        u.flush(5)
        time.sleep(0.5)
        print(f"daemon accepted {d.healthz()['records']} of {2 * N} records")
    finally:
        d.stop()
    absent = Sender("/nonexistent/syncwatch.sock")
    report("daemon absent (dropped)", absent, measure(absent, 0.0))


if __name__ == "__main__":
    main()
