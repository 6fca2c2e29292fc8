"""Datagram ingest: one dedicated reader thread per socket, never the event loop.

Each reader waits in ``poll`` and then drains its socket with non-blocking ``recv`` until it is
empty, decoding and applying records as it goes. It never waits on a scrape: the render works on
a snapshot copied under the state lock. The Unix socket queues only ``net.unix.max_dgram_qlen`` + 1
datagrams (11 by default), so this loop must stay short; senders retry on EAGAIN (sender.py).
The UDP socket asks for a 4 MiB receive buffer (the kernel caps it at ``net.core.rmem_max``).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import threading
import time

from ..protocol import MAX_DATAGRAM, Decoder, ProtocolError
from ..sender import check_unix_path
from .config import parse_daemon_udp
from .state import COUNTED_HERE, State

log = logging.getLogger("syncwatch.daemon")

UDP_RCVBUF = 4 << 20
REJECT_LOG_EVERY = 10.0  # seconds: at most one log line per reject reason per interval


class IngestError(OSError):
    """A socket the daemon cannot open; the message is meant for the operator as is."""


def bind_unix(path: str) -> socket.socket:
    """Bind the Unix datagram socket ``path`` (directory 0750, socket 0660). A stale socket file
    left by a dead daemon is replaced; a live daemon on the path is an error.

    Only "connection refused" proves a socket file stale. Any other failure to probe it (EACCES:
    the socket of a daemon running as another user) says nothing about whether a daemon reads
    it, so the file is left alone: replacing it would take a live daemon's ranks away from it.
    """
    try:
        check_unix_path(path)  # bind() says only "AF_UNIX path too long", with no strerror
    except ValueError as e:
        raise IngestError(str(e)) from None
    directory = os.path.dirname(path) or "."
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o750, exist_ok=True)
            os.chmod(directory, 0o750)
    except OSError as e:
        raise IngestError(f"cannot create socket directory {directory}: {e.strerror}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise IngestError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens (or it is gone already): stale
        except OSError as e:
            raise IngestError(f"{path} exists and cannot be probed ({e.strerror}): it may belong to "
                              f"a daemon running as another user; refusing to replace it") from None
        else:
            raise IngestError(f"{path} is in use by another running daemon")
        finally:
            probe.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise IngestError(f"cannot remove stale socket {path}: {e.strerror}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o660)
    except OSError as e:
        sock.close()
        raise IngestError(f"cannot bind ingest socket {path}: {e.strerror}") from None
    return sock


SD_LISTEN_FDS_START = 3  # first file descriptor systemd passes (sd_listen_fds(3))


def inherited_socket(path: str) -> socket.socket | None:
    """The datagram socket bound to ``path`` that systemd passed us (socket activation through
    deploy/systemd/syncwatch.socket), or None when not socket-activated.

    systemd owns that socket: it outlives daemon restarts with whatever ranks sent meanwhile
    still queued, so the daemon must neither create nor remove the file. Protocol: LISTEN_PID is
    our pid and LISTEN_FDS counts the descriptors from fd 3 on. The variables are cleared so that
    child processes do not take the sockets for theirs.
    """
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        count = 0
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    found = None
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        if (found is None and sock.family == socket.AF_UNIX and sock.type == socket.SOCK_DGRAM
                and sock.getsockname() == path):
            found = sock
        else:
            sock.detach()  # not ours to close
    if found is None:
        raise IngestError(f"systemd passed {count} socket(s) but none is a datagram socket bound "
                          f"to {path}: make ListenDatagram= in syncwatch.socket and --socket agree")
    return found


def bind_udp(address: str) -> socket.socket:
    host, port = parse_daemon_udp(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise IngestError(f"cannot bind UDP ingest {address}: {e.strerror}") from None
    return sock


class Ingest:
    """Owns the ingest sockets and their reader threads."""

    def __init__(self, state: State, socket_path: str | None, udp: str | None):
        self.state = state
        self.socket_path = socket_path
        self.udp_spec = udp
        self.udp_address: str | None = None
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._wake_r, self._wake_w = -1, -1
        self._stopping = False
        self._unix_ino: int | None = None
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._log_lock = threading.Lock()  # the readers log rejects, the event loop flushes

    def start(self) -> None:
        try:
            if self.socket_path:
                s = inherited_socket(self.socket_path)
                if s is None:
                    s = bind_unix(self.socket_path)
                    self._unix_ino = os.stat(self.socket_path).st_ino  # ours to remove at stop
                self._socks.append(s)
            if self.udp_spec:
                s = bind_udp(self.udp_spec)
                self._socks.append(s)
                host, port = s.getsockname()[:2]
                self.udp_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        except BaseException:
            self.stop()
            raise
        self._wake_r, self._wake_w = os.pipe()
        for s in self._socks:
            s.setblocking(False)
            t = threading.Thread(target=self._read, args=(s,), daemon=True,
                                 name=f"syncwatch-ingest-{'unix' if s.family == socket.AF_UNIX else 'udp'}")
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stopping = True
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        for t in self._threads:
            t.join(5.0)
        self._threads.clear()
        self.flush_reject_log(final=True)
        for s in self._socks:
            s.close()
        self._socks.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self.socket_path and self._unix_ino is not None:
            try:  # only our own socket file: a successor may have replaced it already
                if os.stat(self.socket_path).st_ino == self._unix_ino:
                    os.unlink(self.socket_path)
            except OSError:
                pass
            self._unix_ino = None

    def _read(self, sock: socket.socket) -> None:
        decoder = Decoder()
        state = self.state
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        bufsize = MAX_DATAGRAM + 1  # one byte more: an oversized datagram shows as too large
        recv = sock.recv
        decode, apply = decoder.decode, state.apply
        while not self._stopping:
            poller.poll()
            while True:
                try:
                    data = recv(bufsize)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    if not self._stopping:
                        log.error("ingest socket error: %s", e)
                        time.sleep(0.1)
                    break
                try:
                    apply(decode(data))
                except ProtocolError as e:
                    if e.reason not in COUNTED_HERE:
                        state.reject(e.reason)  # apply() counts its own
                    self._log_reject(e)
                except Exception:  # a bug must not kill the reader
                    state.reject("bad_value")
                    log.exception("unexpected error handling a record")

    def _log_reject(self, e: ProtocolError) -> None:
        now = time.monotonic()
        with self._log_lock:
            last = self._last_log.get(e.reason)
            if last is not None and now - last < REJECT_LOG_EVERY:
                self._suppressed[e.reason] = self._suppressed.get(e.reason, 0) + 1
                return
            self._last_log[e.reason] = now
            more = self._suppressed.pop(e.reason, 0)
        log.warning("rejected record: %s%s", e,
                    f" ({more} more like it in the last {REJECT_LOG_EVERY:g} s)" if more else "")

    def flush_reject_log(self, final: bool = False) -> None:
        """Log the rejects the rate limit held back once their interval is over. They were told
        only with the next reject of the same reason: the size of a burst that ended was never
        logged. ``final`` (at stop): all of them, their intervals over or not."""
        now = time.monotonic()
        with self._log_lock:
            held = {reason: self._suppressed.pop(reason) for reason in list(self._suppressed)
                    if final or now - self._last_log[reason] >= REJECT_LOG_EVERY}
        for reason, n in held.items():
            log.warning("rejected %d more record(s) for %s in the last %g s", n, reason,
                        REJECT_LOG_EVERY)
