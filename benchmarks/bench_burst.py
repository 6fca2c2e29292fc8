"""Records lost when 64 sender processes end a step together against a live daemon.

Each of 64 processes (one per rank) sleeps until a shared CLOCK_MONOTONIC deadline and then sends
its step record; 30 such steps. Modes:
  raw     a plain non-blocking send, EAGAIN = lost (what a sender without a retry queue loses)
  sender  syncwatch.sender.Sender (EAGAIN goes to its retry queue, drained within 1 s)
for the Unix datagram socket (queue: net.unix.max_dgram_qlen) and UDP on loopback (4 MiB buffer),
and again while another 448 ranks' state (512 in all) is scraped back to back.

Then the instrumentation's own pattern: a rank's records thread sends the steps of the last
0.2 s in one burst, so a rank with 0.2–1 ms steps sends bursts of 200–1000 records into the
11-datagram Unix queue. 8 processes, each a ``Monitor`` with one phase per step, for 3 s; and
1.5 s of 50 ms steps, then 0.2 ms steps at once (a job's slow first steps, then fast ones).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

from _common import DaemonProcess, encoder, machine, parse_args, step_record

from syncwatch.sender import Sender, parse_udp

RANKS, STEPS, PERIOD = 64, 30, 0.1
MONITOR_RANKS = 8


def rank_main(rank, mode, transport, address, start, out):
    enc = encoder(rank)
    if mode == "sender":
        s = Sender(address) if transport == "unix" else Sender(udp=address)
        send = s.send
    else:
        if transport == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.connect(address)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.connect(parse_udp(address))
        sock.setblocking(False)
        lost = 0

        def send(data):
            nonlocal lost
            try:
                sock.send(data)
            except BlockingIOError:
                lost += 1
    for step in range(1, STEPS + 1):
        data = step_record(enc, step)
        delay = start + step * PERIOD - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        send(data)
    if mode == "sender":
        s.flush(5.0)
        out.put(s.dropped)
    else:
        out.put(lost)


def monitor_rank(rank, address, seconds, step_seconds, slow_seconds, out):
    from syncwatch.instrument.monitor import Monitor
    from syncwatch.protocol import Identity
    m = Monitor(Identity("fast", 0, rank, rank, MONITOR_RANKS, "n1", os.getpid()),
                Sender(address), heartbeat_seconds=0)
    steps, now = 0, time.monotonic()
    slow_end, end = now + slow_seconds, now + slow_seconds + seconds
    while time.monotonic() < end:
        with m.phase("forward"):
            time.sleep(0.05 if time.monotonic() < slow_end else step_seconds)
        m.step(1)
        steps += 1
    m.shutdown()
    out.put((steps, m.sender.dropped))


def run_monitors(step_seconds: float, seconds: float = 3.0,
                 slow_seconds: float = 0.0) -> tuple[int, int, int]:
    """Step records made, accepted by the daemon, and counted as dropped by the ranks; the
    first ``slow_seconds`` with 50 ms steps."""
    d = DaemonProcess()
    try:
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=monitor_rank,
                             args=(r, d.socket, seconds, step_seconds, slow_seconds, out))
                 for r in range(MONITOR_RANKS)]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join()
        time.sleep(0.5)
        accepted = d.healthz()["records"] - MONITOR_RANKS  # less the end records
        return sum(n for n, _ in results), accepted, sum(dr for _, dr in results)
    finally:
        d.stop()


def preload_and_scrape(d: DaemonProcess, stop: threading.Event) -> None:
    """448 more ranks of another job (512 in all), then scrape back to back until ``stop``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.connect(d.socket)
    encs = [encoder(r, world=448, job="other") for r in range(448)]
    for step in range(1, 101):
        for e in encs:
            sock.send(step_record(e, step))
    while not stop.is_set():
        d.metrics()


def run(mode: str, transport: str, scraping: bool = False) -> tuple[int, int, int]:
    d = DaemonProcess(udp=transport == "udp")
    stop = threading.Event()
    scraper = threading.Thread(target=preload_and_scrape, args=(d, stop))
    if scraping:
        scraper.start()
    try:
        address = d.socket if transport == "unix" else d.udp
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        start = time.monotonic() + 2.0  # time for 64 processes to start on 2 cores
        procs = [ctx.Process(target=rank_main, args=(r, mode, transport, address, start, out))
                 for r in range(RANKS)]
        for p in procs:
            p.start()
        lost_at_sender = sum(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join()
        time.sleep(0.5)
        stop.set()
        if scraping:
            scraper.join()
        accepted = d.healthz()["records"] - (448 * 100 if scraping else 0)
        return RANKS * STEPS, accepted, lost_at_sender
    finally:
        stop.set()
        d.stop()


def main() -> None:
    parse_args(__doc__)
    print(f"machine: {machine()}; net.unix.max_dgram_qlen = "
          f"{open('/proc/sys/net/unix/max_dgram_qlen').read().strip()}")
    print(f"{RANKS} processes x {STEPS} steps, all ranks ending each step at the same instant")
    for transport, mode, scraping in (("unix", "raw", False), ("unix", "sender", False),
                                      ("udp", "raw", False), ("udp", "sender", False),
                                      ("unix", "sender", True), ("udp", "raw", True)):
        sent, accepted, lost = run(mode, transport, scraping)
        during = " during back-to-back scrapes of 512 ranks" if scraping else ""
        print(f"{transport:4s} {mode:6s}{during}: sent {sent}, daemon accepted {accepted}, "
              f"lost {sent - accepted} ({100 * (sent - accepted) / sent:.1f} %), "
              f"counted as dropped by the senders {lost}")
    for step_seconds, slow_seconds in ((0.001, 0.0), (0.0002, 0.0), (0.0002, 1.5)):
        made, accepted, dropped = run_monitors(step_seconds, slow_seconds=slow_seconds)
        after = f" after {slow_seconds:g} s of 50 ms steps" if slow_seconds else ""
        print(f"{MONITOR_RANKS} ranks' records threads, {step_seconds * 1e3:.1f} ms steps{after}: "
              f"{made} step records, daemon accepted {accepted}, lost {made - accepted}, "
              f"counted as dropped by the ranks {dropped}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
