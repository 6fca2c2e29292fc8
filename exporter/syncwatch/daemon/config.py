"""Daemon settings. Every field maps to a ``syncwatch daemon`` flag with a SYNCWATCH_* twin."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..sender import UDP_EXAMPLE, check_unix_path, parse_address  # the ranks' rules, which both read

DEFAULT_LISTEN = "127.0.0.1:9477"


def parse_listen(address: str) -> tuple[str, int]:
    """``--listen`` as the daemon binds it (port 0 picks a free one)."""
    return parse_address(address, "listen", DEFAULT_LISTEN, any_port=True)


def parse_daemon_udp(address: str) -> tuple[str, int]:
    """``--udp`` as the daemon binds it (port 0 picks a free one)."""
    return parse_address(address, "udp", UDP_EXAMPLE, any_port=True)


@dataclass
class DaemonConfig:
    listen: str = DEFAULT_LISTEN            # host:port for /metrics and /healthz; port 0 = pick a free one
    socket: str | None = "/run/syncwatch/ingest.sock"  # Unix datagram ingest; None = off
    udp: str | None = None                  # "127.0.0.1:9478" = also ingest UDP on loopback; None = off
    window: int = 100                       # rolling window W (steps) for step CV / lag-1 autocorrelation
    cv_seconds: float = 240.0               # ... of which the CV's: the steps of the last this many seconds
    rank_ttl: float = 60.0                  # seconds without any record before a rank is removed
    job_grace: float = 120.0                # seconds a job's series stay after its end (or last) record
    max_ranks: int = 1024                   # records of further ranks rejected, reason rank_limit
    max_jobs: int = 32                      # records of further jobs rejected, reason job_limit

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"window must be at least 3 steps, got {self.window}")
        if not self.cv_seconds > 0:  # NaN too; inf is the whole window
            raise ValueError(f"cv_seconds must be a positive number of seconds (inf: the whole "
                             f"window), got {self.cv_seconds:g}")
        # NaN passes "<= 0" and then never compares greater: no rank or job would ever expire
        if not (0 < self.rank_ttl < math.inf and 0 <= self.job_grace < math.inf):
            raise ValueError(f"rank_ttl must be > 0 and job_grace >= 0, both finite; got rank_ttl "
                             f"{self.rank_ttl:g}, job_grace {self.job_grace:g}")
        if self.max_ranks < 1 or self.max_jobs < 1:
            raise ValueError("max_ranks and max_jobs must be at least 1")
        parse_listen(self.listen)
        if self.socket:
            check_unix_path(self.socket)
        if self.udp:
            parse_daemon_udp(self.udp)
