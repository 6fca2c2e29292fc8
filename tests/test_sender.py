"""The rank-side sender against a real daemon: absent, restarted, forked, back-pressured."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time

from types import SimpleNamespace

import pytest
from conftest import run_unprivileged, subprocess_env
from daemon_helpers import RankSim, healthz, identity, scrape, value, wait_for, wait_records

from syncwatch import sender as sender_module
from syncwatch.daemon import DaemonConfig, DaemonThread
from syncwatch.sender import Sender, parse_udp


def config(path: str) -> DaemonConfig:
    return DaemonConfig(listen="127.0.0.1:0", socket=path)


def test_daemon_absent_never_raises_and_counts_drops(sock_path):
    s = Sender(sock_path)
    sim = RankSim(identity(0))
    for step in range(1, 101):
        assert s.send(sim.step(step, 0.1)) is False
    s.send(b"")  # even a degenerate payload
    assert (s.sent, s.dropped, s.pending()) == (0, 101, 0)
    s.close()
    assert s.send(b"after close") is False


def test_daemon_restart_on_same_path_records_flow_again_with_right_totals(sock_path):
    s = Sender(sock_path)
    sim = RankSim(identity(0))
    step = 0

    def send_step():
        nonlocal step
        step += 1
        return s.send(sim.step(step, 0.1, dropped=s.dropped))

    with DaemonThread(config(sock_path)) as d:
        for _ in range(10):
            assert send_step()
        wait_records(d.url, 10)
    for _ in range(10):  # daemon down: dropped, no exception
        send_step()
        time.sleep(0.01)
    assert s.dropped == 10
    with DaemonThread(config(sock_path)) as d:
        scrape(d.url)  # Prometheus's first scrape of it, which shows the drops as 0
        # The sender reconnects within its capped backoff; keep training meanwhile.
        def delivered():
            send_step()
            time.sleep(0.02)
            return healthz(d.url)["records"] > 0
        wait_for(delivered, 15, "records to flow after the restart")
        for _ in range(5):
            assert send_step()
        wait_records(d.url, 6)
        m = scrape(d.url)
    lab = dict(train_job="job-a", rank=0)
    # Cumulative counters: nothing sent while the daemon was down is lost from the totals.
    assert value(m, "syncwatch_steps_total", **lab) == step
    assert value(m, "syncwatch_step_seconds_total", **lab) == sim.totals.step_seconds
    # The loss itself is reported by the next records that got through.
    assert sim.totals.dropped_records >= 10
    assert value(m, "syncwatch_client_dropped_records_total") == sim.totals.dropped_records


def test_an_absent_daemon_is_retried_with_a_backoff_capped_at_5_s_restarted_once_connected(
        sock_path, monkeypatch):
    """The sender's contract: while the daemon's socket is gone it connects again after a backoff
    of 0.05 s doubling to 5 s, so an absent daemon costs a connect now and then, not one per
    record, and one back after a long absence gets records again within 5 s; a connect that
    succeeds starts the backoff again at 0.05 s, so the next short absence costs a record or
    two, not 5 s of them. The restart test above looks at none of these times: a sender whose
    backoff never grew, grew without bound or never started again passed it. Real sockets, the
    sender's clock stepped by hand (a record every 0.25 s)."""
    now = 0.0
    monkeypatch.setattr(sender_module, "time",
                        SimpleNamespace(monotonic=lambda: now, sleep=time.sleep))
    s = Sender(sock_path)

    def daemon() -> socket.socket:
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        rx.bind(sock_path)
        rx.settimeout(1)
        return rx

    def gone(rx: socket.socket) -> None:
        rx.close()
        os.unlink(sock_path)

    def first_sent(until: float) -> float:
        """Send a record every 0.25 s from now until ``until``: the time the first one left
        (infinite: none did)."""
        nonlocal now
        while now < until:
            if s.send(b"%g" % now):
                return now
            now += 0.25
        return math.inf

    try:
        assert first_sent(60.0) == math.inf  # a minute without a daemon
        assert (s.sent, s.dropped) == (0, 240)
        rx, back = daemon(), now
        assert back < first_sent(back + 10) <= back + 5.0  # the backoff grew, to 5 s at most
        assert rx.recv(64) == b"%g" % now
        gone(rx)  # a short absence: refused, then absent; the backoff starts again at 0.05 s
        assert s.send(b"refused") is False
        now += 0.25
        assert s.send(b"absent") is False
        rx, back = daemon(), now
        assert first_sent(back + 10) == back + 0.25  # the next record
        assert rx.recv(64) == b"%g" % now
        gone(rx)  # a restart between two records: the refused one is lost, the next one goes
        rx = daemon()
        assert s.send(b"refused") is False
        assert s.send(b"at once")
        assert rx.recv(64) == b"at once"
        assert s.sent == 3
    finally:
        s.close()
        rx.close()

def test_fork_child_sends_and_parent_is_unaffected(sock_path):
    with DaemonThread(config(sock_path)) as d:
        s = Sender(sock_path)
        parent = RankSim(identity(0))
        assert s.send(parent.step(1, 0.1))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: a fresh socket, its own counters
            try:
                child = RankSim(identity(1, pid=os.getpid()))
                ok = all(s.send(child.step(i, 0.2)) for i in range(1, 6))
                os.write(w, f"{int(ok)} {s.sent} {s.dropped}".encode())
            finally:
                os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        report = os.read(r, 100).decode()
        os.close(r)
        assert status == 0 and report == "1 5 0", report
        assert s.send(parent.step(2, 0.1))
        wait_records(d.url, 7)
        m = scrape(d.url)
    assert (s.sent, s.dropped) == (2, 0)
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 2
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=1) == 5


def test_eagain_burst_is_retried_and_delivered_after_reader_resumes(sock_path):
    """With the daemon's reader stalled the socket queue (net.unix.max_dgram_qlen + 1, 11 by default)
    fills; the sender queues the rest and delivers it once the reader runs again."""
    with DaemonThread(config(sock_path)) as d:
        s = Sender(sock_path, retry_seconds=5.0)
        sim = RankSim(identity(0))
        with d.state._lock:  # the reader blocks on the state lock: nothing is read meanwhile
            for step in range(1, 51):
                assert s.send(sim.step(step, 0.1))
            assert s.pending() > 0  # the queue filled: EAGAIN happened and was absorbed
            time.sleep(0.2)
        assert s.flush(10.0)
        wait_records(d.url, 50)
        m = scrape(d.url)
    assert (s.sent, s.dropped) == (50, 0)
    assert value(m, "syncwatch_ingest_records_total") == 50
    assert value(m, "syncwatch_steps_total", train_job="job-a", rank=0) == 50
    # Arrived in order: no step record was discarded as out of order.
    assert value(m, "syncwatch_step_duration_seconds_count", train_job="job-a", node="node-1") == 50


def test_records_sent_while_the_retry_queue_drains_join_it_in_order(sock_path):
    """While records wait in the retry queue (the daemon's socket was full), new ones join it:
    sent at once into room the reader has just made, they would overtake the queued ones, which
    the daemon then discards as out of order. The test above sends nothing while its queue
    drains: a sender that let new records overtake passed it."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a daemon's socket, read by hand
    rx.bind(sock_path)
    rx.settimeout(5)
    s = Sender(sock_path, retry_seconds=10.0)
    sent = 0

    def send():
        nonlocal sent
        sent += 1
        assert s.send(b"%d" % sent)
    try:
        while s.pending() < 5:  # the socket's queue is full, and 5 records wait in the sender's
            send()
        got = []
        for _ in range(20):  # the reader makes room for one record; the rank sends one meanwhile
            got.append(int(rx.recv(64)))
            send()
        while len(got) < sent:
            got.append(int(rx.recv(64)))
        assert s.flush(5.0)  # the retry thread done with the last one: close() counts what waits
        assert got == list(range(1, sent + 1))
        assert (s.sent, s.dropped) == (sent, 0)
    finally:
        s.close()
        rx.close()


def test_a_record_the_retry_thread_sends_as_the_sender_closes_is_counted_once(sock_path):
    """close() counted every queued record as dropped, the one the retry thread had just sent
    but not yet taken off the queue included, and the thread then counted it as sent too: a
    record counted twice, one too many drops. Here close() comes between that send and the
    queue's update."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a daemon's socket, read by hand
    rx.bind(sock_path)
    rx.setblocking(False)
    s = Sender(sock_path, retry_seconds=10.0)
    send, closer = s._try_send, []

    def send_then_close(data):
        if threading.current_thread().name != "syncwatch-sender" or closer:
            return send(data)
        rx.recv(64)  # room for the queued record, which leaves now
        ok = send(data)
        closer.append(threading.Thread(target=s.close))
        closer[0].start()
        time.sleep(0.05)  # close() runs before this thread takes the record off its queue
        return ok
    try:
        n = 0
        while s.pending() < 1:  # the socket's queue full: the next records wait in the sender's
            n += 1
            assert s.send(b"%d" % n)
        s._try_send = send_then_close
        s._wake.set()
        wait_for(lambda: closer and not closer[0].is_alive(), 5.0, "close()")
        s._thread.join(5.0)  # the retry thread done with its record too
        received = 1  # the one read to make room
        while True:
            try:
                rx.recv(64)
            except BlockingIOError:
                break
            received += 1
        assert (s.sent, s.dropped) == (received, n - received)
    finally:
        s.close()
        rx.close()


def test_the_retry_queue_drops_its_oldest_when_full_and_what_ages_out(sock_path):
    """The sender's contract: a record in the retry queue is dropped and counted only when the
    queue overflows (the oldest goes) or the record waited ``retry_seconds``. The EAGAIN tests
    never filled the queue nor let a record age: a sender whose queue grew without bound, or
    that retried a record for ever, passed them."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a daemon's socket, not read yet
    rx.bind(sock_path)
    rx.settimeout(0.5)
    s = Sender(sock_path, retry_seconds=10.0, retry_queue=4)
    aging = Sender(sock_path, retry_seconds=0.2)
    try:
        n = 0
        while s.pending() < 4:  # the socket's queue full, then the sender's
            n += 1
            assert s.send(b"%d" % n)
        for _ in range(6):  # six more: each pushes the oldest waiting one out
            n += 1
            assert s.send(b"%d" % n)
        assert (s.pending(), s.dropped) == (4, 6)
        got = []
        try:
            while True:
                got.append(int(rx.recv(64)))
        except socket.timeout:
            pass
        assert s.flush(5.0)
        queued = len(got) - 4  # what the socket held, then the 4 the sender kept: the newest
        assert got == list(range(1, queued + 1)) + list(range(n - 3, n + 1)), got
        assert (s.sent, s.dropped, s.pending()) == (len(got), 6, 0)

        while aging.pending() < 2:  # nobody reads: they wait retry_seconds, then go
            assert aging.send(b"0")
        assert aging.dropped == 0
        assert wait_for(lambda: aging.pending() == 0, 5, "the waiting records to age out")
        assert aging.dropped == 2
    finally:
        s.close()
        aging.close()
        rx.close()


def _send_unprivileged(path: str, records: list[bytes]) -> dict:
    """Send ``records`` through a fresh Sender in a child without root's rights (root ignores
    file modes) and report its counts and what it logged."""
    def work():
        logged = []
        handler = logging.Handler()
        handler.emit = lambda record: logged.append(record.getMessage())
        logging.getLogger("syncwatch.sender").addHandler(handler)
        s = Sender(path)
        for data in records:
            s.send(data)
            s._next_connect = 0.0  # no backoff: every send tries to connect again
        return {"sent": s.sent, "dropped": s.dropped, "logged": logged}
    return run_unprivileged(work)


def test_no_permission_on_the_socket_is_said_once(sock_path):
    """A rank outside the daemon's group got EACCES on connect and dropped every record without
    a word: the daemon never hears of it, and the rank's drop count never reaches the daemon."""
    with DaemonThread(config(sock_path)) as d:
        if os.geteuid() != 0:
            os.chmod(sock_path, 0)
        os.chmod(os.path.dirname(sock_path), 0o711)  # the socket file itself says no
        sim = RankSim(identity(0))
        out = _send_unprivileged(sock_path, [sim.step(step, 0.1) for step in range(1, 6)])
        assert (out["sent"], out["dropped"]) == (0, 5)
        assert len(out["logged"]) == 1, out["logged"]
        message = out["logged"][0]
        assert sock_path in message and "Permission denied" in message
        assert "must run as root or in the socket's group" in message
        mode = "660" if os.geteuid() == 0 else "0"
        assert f"gid {os.getegid()} mode {mode}" in message  # who owns it, how
        assert healthz(d.url)["records"] == 0


@pytest.mark.parametrize("given", ["argument", "environment"])
def test_a_socket_path_too_long_for_unix_sockets_is_said_once(tmp_path, monkeypatch, caplog,
                                                              given):
    """A ``SYNCWATCH_SOCKET`` over the 107 bytes of a Unix socket path: every connect raised
    "AF_UNIX path too long" and every record was dropped without a word (only permission errors
    were warned about). Now one warning names the path, its length and the limit."""
    path = str(tmp_path / ("s" * (108 - len(str(tmp_path)) - 1)))
    assert len(path) == 108
    if given == "environment":
        monkeypatch.setenv("SYNCWATCH_SOCKET", path)
    with caplog.at_level(logging.WARNING, logger="syncwatch.sender"):
        s = Sender(path if given == "argument" else None)
        assert [s.send(b"record") for _ in range(20)] == [False] * 20
    assert (s.sent, s.dropped, s.address) == (0, 20, None)
    source = "socket" if given == "argument" else "SYNCWATCH_SOCKET"
    assert [r.getMessage() for r in caplog.records] == [
        f"syncwatch: ignoring {source}: socket path {path} is 108 bytes; a Unix socket path has "
        "at most 107: choose a shorter one; this process sends nothing to the daemon: every "
        "record is dropped"]


@pytest.mark.parametrize("transport", ["unix", "udp"])
def test_a_daemon_restart_counts_each_dropped_record_once(sock_path, transport):
    """Records carry the rank's cumulative drop count, and a daemon meeting a rank's process
    counted all of it: after a restart the new daemon exported the drops its predecessor had
    already exported again, and Prometheus's increase() over the restart (a counter reset: the
    new daemon's count added to the old one's) counted them twice. Each drop counts once, those
    made while the daemon was down included. Over UDP a send to nobody succeeds (only the next
    one is refused), and each such record counted as delivered: a restarted daemon took drops
    that no daemon had been told of as counted (1 of 20)."""
    from syncwatch.instrument.monitor import Monitor

    if transport == "udp":
        address = f"127.0.0.1:{free_udp_port()}"
        sender = Sender(udp=address)
        daemon = DaemonConfig(listen="127.0.0.1:0", socket=None, udp=address)
    else:
        sender, daemon = Sender(sock_path), config(sock_path)
    m = Monitor(identity(0), sender, heartbeat_seconds=0)
    lab = dict(train_job="job-a", rank=0)

    def step():
        m.step(1)
        m.flush()

    def exported(d) -> float:
        """Step until the daemon has the rank's latest step; its drop count then."""
        def caught_up():
            step()
            time.sleep(0.02)
            return value(scrape(d.url), "syncwatch_last_step", **lab) == m.last_step
        wait_for(caught_up, 15, "the daemon to catch up with the rank")
        return value(scrape(d.url), "syncwatch_client_dropped_records_total")

    try:
        for _ in range(5):  # no daemon yet: dropped
            step()
        with DaemonThread(daemon) as d:
            before = exported(d)
        assert before == m.sender.dropped >= 5
        for _ in range(7):  # the daemon restarts: dropped
            step()
        with DaemonThread(daemon) as d:
            after = exported(d)
        assert m.sender.dropped >= before + 7
        assert before + after == m.sender.dropped, (before, after, m.sender.dropped)
    finally:
        m.shutdown(timeout=0.5)


def test_over_udp_a_datagram_nobody_received_is_dropped_not_delivered():
    """A connected UDP socket's send to a port nobody listens on succeeds; the ICMP
    port-unreachable it draws fails the next send. That first datagram was counted sent, and the
    counts it carried as delivered: the rank's next records told a daemon they had been counted."""
    s = Sender(udp=f"127.0.0.1:{free_udp_port()}")
    assert s.send(b"first", (0, 0))
    assert s.send(b"second", (0, 0)) is False  # refused: first reached nobody
    assert (s.sent, s.dropped, s.delivered) == (0, 2, (0, 0))
    assert s.send(b"third", (2, 0))  # a fresh socket; in flight, unconfirmed
    assert s.delivered == (2, 0)  # the next record reaches a daemon only if third did
    assert s.send(b"fourth", (2, 0)) is False
    assert (s.sent, s.dropped, s.delivered) == (0, 4, (0, 0))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:  # a daemon's socket
        rx.bind(s.address)
        for i in range(3):
            assert s.send(b"live %d" % i, (4, i))
        assert [rx.recv(100) for _ in range(3)] == [b"live 0", b"live 1", b"live 2"]
    assert (s.sent, s.dropped, s.delivered, s._confirmed) == (3, 4, (4, 2), (4, 1))
    s.close()


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_daemon_and_its_ranks_read_syncwatch_udp_alike(monkeypatch):
    """``:PORT`` (no host) made the daemon bind 127.0.0.1:PORT and each rank's Sender raise
    ValueError: the instrumentation did not start. One parser, one meaning: 127.0.0.1."""
    address = f":{free_udp_port()}"
    monkeypatch.setenv("SYNCWATCH_UDP", address)
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=None, udp=address)) as d:
        s = Sender()
        assert s.address == parse_udp(address) == ("127.0.0.1", int(address[1:]))
        sim = RankSim(identity(0))
        for step in range(1, 6):
            assert s.send(sim.step(step, 0.1))
        wait_records(d.url, 5)
        s.close()


@pytest.mark.parametrize("address, says, daemon_says", [
    ("127.0.0.1:70000", "UDP address '127.0.0.1:70000': the port must be from 1 to 65535",
     "udp '127.0.0.1:70000': the port must be from 0 to 65535"),
    ("127.0.0.1:0", "UDP address '127.0.0.1:0': the port must be from 1 to 65535",
     None),  # a daemon may bind port 0 (it gets a free port); nothing can send to it
    ("127.0.0.1:", "UDP address must look like 127.0.0.1:9478, got '127.0.0.1:'",
     "udp must look like 127.0.0.1:9478, got '127.0.0.1:'"),
    ("127.0.0.1", "UDP address must look like 127.0.0.1:9478, got '127.0.0.1'",
     "udp must look like 127.0.0.1:9478, got '127.0.0.1'"),
])
def test_a_bad_syncwatch_udp_is_said_once_and_every_record_is_dropped(monkeypatch, caplog,
                                                                       address, says, daemon_says):
    """A port over 65535 passed the sender's parser and every connect raised OverflowError,
    swallowed: all records dropped without a word (the daemon refused the same value). Port 0
    reached nobody. Now the sender says so once and counts every record dropped."""
    monkeypatch.setenv("SYNCWATCH_UDP", address)
    with caplog.at_level(logging.WARNING, logger="syncwatch.sender"):
        s = Sender()
        assert [s.send(b"record") for _ in range(20)] == [False] * 20
    assert (s.sent, s.dropped, s.address) == (0, 20, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"syncwatch: ignoring SYNCWATCH_UDP: {says}; this process sends nothing to the daemon: "
        "every record is dropped"]
    if daemon_says is None:
        DaemonConfig(listen="127.0.0.1:0", socket=None, udp=address)
    else:
        with pytest.raises(ValueError) as refused:
            DaemonConfig(listen="127.0.0.1:0", socket=None, udp=address)
        assert str(refused.value) == daemon_says


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="needs torch (pip install -e '.[test]')")
@pytest.mark.parametrize("bad", [False, True])
def test_syncwatch_udp_as_the_instrumentation_reads_it(bad):
    """In a rank, ``sw.init()`` with ``:PORT`` did not start (the Sender's ValueError), and with
    a port over 65535 started and dropped everything silently. ``:PORT`` now reaches the daemon
    on 127.0.0.1; a bad value is said once and the rank trains, instrumented, sending nothing."""
    port = free_udp_port()
    address = "127.0.0.1:70000" if bad else f":{port}"
    code = ("import torch.distributed as dist, syncwatch.instrument as sw\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "m = sw.init(exchange_every=0)\n"
            "for _ in range(3): sw.step(1)\n"
            "sw.shutdown()\n"
            "print(m is not None, m and m.sender.dropped)\n")
    with DaemonThread(DaemonConfig(listen="127.0.0.1:0", socket=None, udp=f":{port}")) as d:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=subprocess_env(SYNCWATCH_UDP=address,
                                                             SYNCWATCH_JOB="udp-env"))
        assert out.returncode == 0, out.stderr[-2000:]
        started, dropped = out.stdout.split()
        assert started == "True", out.stderr[-2000:]
        if bad:
            assert int(dropped) >= 4  # 3 steps and the end record at least
            assert out.stderr.count("ignoring SYNCWATCH_UDP: UDP address '127.0.0.1:70000'") == 1
            assert healthz(d.url)["records"] == 0
        else:
            assert dropped == "0" and "SYNCWATCH_UDP" not in out.stderr, out.stderr[-2000:]
            wait_records(d.url, 4)
