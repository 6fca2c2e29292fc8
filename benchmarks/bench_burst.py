"""Records lost when 64 sender processes end a step together against a live daemon.

Each of 64 processes (one per rank) sleeps until a shared CLOCK_MONOTONIC deadline and then sends
its step record; 30 such steps. Modes:
  raw     a plain non-blocking send, EAGAIN = lost (what a sender without a retry queue loses)
  sender  syncwatch.sender.Sender (EAGAIN goes to its retry queue, drained within 1 s)
for the Unix datagram socket (queue: net.unix.max_dgram_qlen) and UDP on loopback (4 MiB buffer).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

from _common import DaemonProcess, encoder, machine, step_record

from syncwatch.sender import Sender, parse_udp

RANKS, STEPS, PERIOD = 64, 30, 0.1


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


def run(mode: str, transport: str) -> tuple[int, int, int]:
    d = DaemonProcess(udp=transport == "udp")
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
        accepted = d.healthz()["records"]
        return RANKS * STEPS, accepted, lost_at_sender
    finally:
        d.stop()


def main() -> None:
    print(f"machine: {machine()}; net.unix.max_dgram_qlen = "
          f"{open('/proc/sys/net/unix/max_dgram_qlen').read().strip()}")
    print(f"{RANKS} processes x {STEPS} steps, all ranks ending each step at the same instant")
    for transport in ("unix", "udp"):
        for mode in ("raw", "sender"):
            sent, accepted, lost = run(mode, transport)
            print(f"{transport:4s} {mode:6s}: sent {sent}, daemon accepted {accepted}, "
                  f"lost {sent - accepted} ({100 * (sent - accepted) / sent:.1f} %), "
                  f"counted as dropped by the senders {lost}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
