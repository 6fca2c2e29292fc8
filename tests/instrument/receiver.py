"""A plain ingest endpoint for unit tests: a real Unix datagram socket decoded with the real
``Decoder`` (the daemon is tested on its own; these tests look at exactly what a rank sends)."""

import socket
import threading

from syncwatch.protocol import Decoder


class Receiver:
    def __init__(self, path: str):
        self.path = path
        self.records: list = []
        self.rejected: list = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.1)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        dec = Decoder()
        while not self._stop:
            try:
                data = self._sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                self.records.append(dec.decode(data))
            except Exception as e:
                self.rejected.append(e)

    def of(self, kind):
        return [r for r in list(self.records) if isinstance(r, kind)]

    def close(self):
        self._stop = True
        self._thread.join(1)
        self._sock.close()
