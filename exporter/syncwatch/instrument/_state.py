"""Process-wide state shared by the API, the hooks and the zero-code patches."""

import os
import time

from ..protocol import PHASE_INDEX
from .monitor import EXIT, STEP
from .notes import Notes

monitor = None   # the rank's Monitor once init() succeeded; None = everything is a no-op
in_ddp_hook = 0  # >0 while a DDP comm hook runs: its own collectives are not counted twice
CUSTOM_PHASES = 64  # names outside the protocol's phases that are remembered (all count as other)

notes = Notes(STEP, time.time)
"""The API's notes (``syncwatch.instrument.step`` is its ``step``), bound to the current
monitor by ``set_monitor``; unbound, every phase and step does nothing."""


class Phases(dict):
    """Phase name -> the API's context manager for it. ``syncwatch.instrument.phase`` is this
    dict's ``__getitem__``: a lookup in C, without a Python frame, which after a backward pass
    (the interpreter's caches cold) saves ~0.5 us per phase. A name outside the protocol's
    phases counts as ``other``: ``__missing__`` gives it other's object and remembers up to
    ``CUSTOM_PHASES`` such names."""

    def __missing__(self, name):
        p = self["other"]
        if len(self) < len(PHASE_INDEX) + CUSTOM_PHASES:
            self[name] = p
        return p


phases = Phases({name: notes.phase(i, i + EXIT) for name, i in PHASE_INDEX.items()})


def set_monitor(m) -> None:
    """Make ``m`` (or None: nothing) the monitor that the API, hooks and wrappers report to."""
    global monitor
    monitor = m
    if m is None:
        notes.bind()
    else:
        notes.bind(m._put, m._mark, m._error)


# A forked child (a DataLoader worker) is not the rank: it has no records thread to send what it
# would note, and its records would carry the rank's identity. The API is a no-op there.
os.register_at_fork(after_in_child=lambda: set_monitor(None))
