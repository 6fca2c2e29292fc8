"""Fire-and-forget datagram sender used inside training ranks.

Contract: ``send()`` never raises and never blocks the caller. The common case is one
non-blocking ``send`` on a connected socket (~0.4 us). What can go wrong, and what happens:

* daemon absent (no socket file, nothing listening): the record is dropped and counted; the
  sender reconnects with capped exponential backoff (0.05 s doubling to 5 s), so a daemon that
  comes back receives records again within the backoff;
* daemon restarted (our connected socket points at the old, closed one): ECONNREFUSED, so we
  reconnect at once on the next send;
* over UDP a send to nobody succeeds: the kernel's ICMP port-unreachable comes back and the
  *next* send on that socket fails with ECONNREFUSED (on loopback at once: Linux does not
  rate-limit ICMP there; see docs/daemon.md for other interfaces). So a datagram is known delivered only once a later send on the
  same socket was not refused, and a refusal counts the datagram before it as dropped too;
* the daemon's queue is full (EAGAIN; a Unix datagram socket queues only
  ``net.unix.max_dgram_qlen`` + 1 datagrams, 11 by default): the record goes to a small retry queue
  that a background thread drains with 1 ms pauses for up to ``retry_seconds``; while that queue
  is non-empty new records join it so they arrive in order. Only when it overflows or a record
  ages out is it dropped and counted;
* ``fork`` (DataLoader workers): an ``os.register_at_fork`` hook gives the child a fresh socket,
  queue, lock and counters; the retry thread is started again on first need;
* no permission on the socket (the process is neither root nor in the daemon's group): like an
  absent daemon, plus one warning per sender that says so, since nothing else would: the daemon
  never hears of the rank, and the drop count the rank keeps never reaches it;
* a socket path over ``MAX_UNIX_PATH`` bytes, or a bad ``SYNCWATCH_UDP``: no daemon can be reached
  there, so one warning when the sender is made, and every record is dropped and counted.

``dropped`` is cumulative; callers put it into their next record so the daemon sees the loss.
A caller may pass a record's ``counts`` (the drop and error counts it carries) to ``send()``:
once that record has left, ``delivered`` holds them, and the next records say so, so that a daemon
meeting the rank anew (after its restart) counts only the drops no record delivered before told of.
Over UDP ``delivered`` is the counts of the last datagram sent on the current socket: the next
record reaches a daemon only if its own send is not refused, which confirms that datagram; after a
refusal it goes back to the counts of the last one confirmed. A record sent while the daemon was
down thus never makes a restarted daemon take its drops as counted before (it counted 1 of 20).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
import weakref

DEFAULT_SOCKET = "/run/syncwatch/ingest.sock"
ENV_SOCKET = "SYNCWATCH_SOCKET"
ENV_UDP = "SYNCWATCH_UDP"
UDP_EXAMPLE = "127.0.0.1:9478"  # the daemon's UDP ingest as the docs give it

MAX_UNIX_PATH = 107  # bytes: sun_path holds 108 with the terminating NUL

_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 5.0

log = logging.getLogger("syncwatch.sender")

# Every live sender, so a forked child can reset them all before it runs any code. A hook is
# cheaper than comparing os.getpid() on every send (a real syscall: 0.05-0.5 us).
_SENDERS: "weakref.WeakSet[Sender]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sender in list(_SENDERS):
        sender._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def parse_address(address: str, what: str, example: str, *,
                  any_port: bool = False) -> tuple[str, int]:
    """``"127.0.0.1:9478"``, ``"[::1]:9478"`` or ``":9478"`` (host 127.0.0.1) -> (host, port).
    ``what`` names the setting in errors, ``example`` shows a good value of it.

    The one parser of ``SYNCWATCH_UDP``, which the daemon and the ranks read alike, and of the
    daemon's other addresses (the two had their own rules: a port over 65535 stopped the daemon
    and made every send of the ranks fail, and an empty host stopped the ranks' instrumentation).
    Port 0 only where ``any_port``: a daemon binding it gets a free port; nothing can send to it.
    """
    host, sep, port = address.rpartition(":")
    if not (sep and port.isascii() and port.isdigit()):
        raise ValueError(f"{what} must look like {example}, got {address!r}")
    lowest = 0 if any_port else 1
    if not lowest <= int(port) <= 65535:
        raise ValueError(f"{what} {address!r}: the port must be from {lowest} to 65535")
    return host.strip("[]") or "127.0.0.1", int(port)


def check_unix_path(path: str) -> str:
    """``path`` if a Unix socket can have it, else ``ValueError``: ``connect()`` and ``bind()``
    raise only "AF_UNIX path too long", without the path, its length or the limit."""
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise ValueError(f"socket path {path} is {size} bytes; a Unix socket path has at most "
                         f"{MAX_UNIX_PATH}: choose a shorter one")
    return path


def parse_udp(address: str) -> tuple[str, int]:
    """The daemon's UDP address as a rank sends to it (``SYNCWATCH_UDP``, ``--udp``)."""
    return parse_address(address, "UDP address", UDP_EXAMPLE)


class Sender:
    def __init__(self, path: str | None = None, udp: str | None = None,
                 retry_seconds: float = 1.0, retry_queue: int = 1024):
        """Send to the Unix datagram socket ``path`` (default ``$SYNCWATCH_SOCKET`` or
        ``/run/syncwatch/ingest.sock``), or to UDP ``host:port`` when ``udp`` (or ``$SYNCWATCH_UDP``)
        is set."""
        source = "udp" if udp is not None else ENV_UDP
        udp = udp if udp is not None else os.environ.get(ENV_UDP) or None
        if udp:
            try:
                host, port = parse_udp(udp)
                self._address: object = (host, port)
            except ValueError as e:
                # Said once, here; the rank trains on, its records dropped and counted, rather
                # than have init() fail (the instrumentation did not start).
                log.warning("syncwatch: ignoring %s: %s; this process sends nothing to the "
                            "daemon: every record is dropped", source, e)
                host, self._address = "", None
            self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        else:
            self._family = socket.AF_UNIX
            source = "socket" if path else ENV_SOCKET
            try:
                self._address = check_unix_path(path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET)
            except ValueError as e:
                log.warning("syncwatch: ignoring %s: %s; this process sends nothing to the "
                            "daemon: every record is dropped", source, e)
                self._address = None
        self._udp = self._family != socket.AF_UNIX
        self.retry_seconds = retry_seconds
        self._queue_max = retry_queue
        self._warned_permission = False  # not reset at fork: one warning per rank, not per worker
        self._reset()
        _SENDERS.add(self)

    def _reset(self) -> None:
        """Fresh per-process state. In a forked child the counters restart at zero: the child
        sends under its own identity, so the parent's drops must not be reported twice. Releasing
        the inherited socket object closes only the child's copy of the descriptor."""
        self.dropped = 0
        self.sent = 0
        self.delivered: tuple[int, int] = (0, 0)  # ``counts`` of the last record delivered
        # UDP: the counts of the last datagram confirmed delivered, and whether the last one sent
        # on the current socket awaits the next send's verdict
        self._confirmed: tuple[int, int] = (0, 0)
        self._unconfirmed = False
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._backoff = _BACKOFF_MIN
        self._pending: collections.deque[tuple[float, bytes, tuple[int, int] | None]] = \
            collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> object:
        return self._address

    def _connect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self._next_connect or self._address is None:
            return None
        s = socket.socket(self._family, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.connect(self._address)
        except OSError as e:
            s.close()
            if e.errno in (errno.EACCES, errno.EPERM) and not self._warned_permission:
                self._warn_permission(e)
            self._next_connect = now + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
            return None
        self._backoff = _BACKOFF_MIN
        self._sock = s
        return s

    def _warn_permission(self, e: OSError) -> None:
        self._warned_permission = True
        owner = ""
        if self._family == socket.AF_UNIX:
            try:
                st = os.stat(self._address)
                owner = f" (socket uid {st.st_uid} gid {st.st_gid} mode {st.st_mode & 0o777:o})"
            except OSError:
                pass  # the directory itself is closed to us
        log.warning("syncwatch: cannot send to the daemon at %s: %s%s; this process (uid %d, "
                    "groups %s) must run as root or in the socket's group: every record is "
                    "dropped until then (see docs/deploy.md)", self._address, e.strerror, owner,
                    os.geteuid(), sorted({os.getegid(), *os.getgroups()}))

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _try_send(self, data: bytes) -> bool | None:
        """True: sent. False: lost for good. None: queue full at the receiver (EAGAIN), retry."""
        s = self._sock or self._connect()
        if s is None:
            return False
        try:
            s.send(data)
            return True
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN, errno.EDESTADDRREQ,
                           errno.EPIPE):
                # Daemon restarted or gone: reconnect on the next send, at once.
                self._drop_socket()
                self._next_connect = 0.0
                if self._unconfirmed:
                    self._lost_in_flight()
            return False

    def send(self, data: bytes, counts: tuple[int, int] | None = None) -> bool:
        """Queue ``data`` for the daemon. Returns True if it left now or waits in the retry queue.
        ``counts``: the (dropped, internal errors) counts ``data`` reports; ``delivered`` once it
        has left."""
        try:
            if self._closed:
                self._drop()
                return False
            if self._pending:
                return self._enqueue(data, counts)
            ok = self._try_send(data)
            if ok:
                self._delivered(counts)
                return True
            if ok is None:
                return self._enqueue(data, counts)
            self._drop()
            return False
        except Exception:  # never into the training loop
            self.dropped += 1
            return False

    def _delivered(self, counts: tuple[int, int] | None) -> None:
        self.sent += 1
        if self._udp:  # not refused: the datagram sent before this one on this socket arrived
            self._confirmed = self.delivered
            self._unconfirmed = True
        if counts is not None:
            self.delivered = counts

    def _lost_in_flight(self) -> None:
        """UDP: a send on the socket failed (ECONNREFUSED: the ICMP port-unreachable the datagram
        before it drew), so that datagram reached nobody."""
        self._unconfirmed = False
        self.delivered = self._confirmed
        self.sent -= 1
        self._drop()

    def _drop(self) -> None:
        # The retry thread counts too; ``+=`` on an attribute is not atomic across threads.
        with self._lock:
            self.dropped += 1

    def _enqueue(self, data: bytes, counts: tuple[int, int] | None) -> bool:
        with self._lock:
            if len(self._pending) >= self._queue_max:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append((time.monotonic() + self.retry_seconds, data, counts))
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="syncwatch-sender",
                                                daemon=True)
                self._thread.start()
        self._wake.set()
        return True

    def _drain(self) -> None:
        while not self._closed:
            self._wake.wait(1.0)
            self._wake.clear()
            while self._pending and not self._closed:
                deadline, data, counts = self._pending[0]
                ok = self._try_send(data)
                if ok is None and time.monotonic() < deadline:
                    time.sleep(0.001)
                    continue
                with self._lock:
                    if self._pending and self._pending[0][1] is data:
                        self._pending.popleft()
                if ok:
                    self._delivered(counts)
                else:
                    self._drop()

    def pending(self) -> int:
        return len(self._pending)

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait up to ``timeout`` for the retry queue to drain (for shutdown, never per step)."""
        end = time.monotonic() + timeout
        while self._pending and time.monotonic() < end:
            time.sleep(0.001)
        return not self._pending

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # a record the retry thread is sending is its to count: sent, it was counted as
            # dropped here too (still at the queue's head), a record counted twice
            thread.join(0.1)
        with self._lock:
            self.dropped += len(self._pending)
            self._pending.clear()
        self._drop_socket()
