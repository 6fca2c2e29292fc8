"""The per-node daemon: datagram ingest, bounded per-rank state, /metrics and /healthz.

``create_app`` / ``start_daemon`` / ``DaemonThread`` (app.py) are the entry points; ``DaemonConfig``
(config.py) holds every setting.
"""

from .app import DaemonThread, RunningDaemon, create_app, start_daemon
from .config import DaemonConfig

__all__ = ["DaemonConfig", "DaemonThread", "RunningDaemon", "create_app", "start_daemon"]
