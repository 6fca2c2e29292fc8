"""Process-wide state shared by the API, the hooks and the zero-code patches."""

import os

from ..protocol import PHASES

monitor = None   # the rank's Monitor once init() succeeded; None = everything is a no-op
in_ddp_hook = 0  # >0 while a DDP comm hook runs: its own collectives are not counted twice
CUSTOM_PHASES = 64  # names outside the protocol's phases that are remembered (all count as other)


class _Null:
    """The phase context when nothing is initialized."""
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False


NULL = _Null()


class Phases(dict):
    """Phase name -> context manager: the monitor's reusable phase objects, or ``NULL`` while
    nothing is initialized. ``syncwatch.instrument.phase`` is this dict's ``__getitem__``: a
    lookup in C, without a Python frame, which after a backward pass (the interpreter's caches
    cold) saves ~0.5 us per phase; names not seen yet go through ``__missing__``."""

    def __missing__(self, name):
        m = monitor
        if m is None:
            return NULL
        p = m.phase(name)
        if name in m._phases:  # remembered by the monitor (up to CUSTOM_PHASES): here too
            self[name] = p
        return p


phases = Phases.fromkeys(PHASES, NULL)


def set_monitor(m) -> None:
    """Make ``m`` (or None: nothing) the monitor that the API, hooks and wrappers report to."""
    global monitor
    monitor = m
    phases.clear()
    phases.update(m._phases if m is not None else dict.fromkeys(PHASES, NULL))


# A forked child (a DataLoader worker) is not the rank: it has no records thread to send what it
# would note, and its records would carry the rank's identity. The API is a no-op there.
os.register_at_fork(after_in_child=lambda: set_monitor(None))
