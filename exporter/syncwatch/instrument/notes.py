"""What the training thread runs per phase and per step: it takes a note and goes on.

A ``Notes`` object, bound to a monitor with ``bind(put, clock, on_error)``, appends *entries* —
tuples of an entry code and a clock mark — with ``put`` (the monitor's ``deque.append``: atomic,
no lock, no syscall); the monitor's records thread turns them into step records. Its phase
context managers (``phase(start, end)``) note ``start`` on entry and ``end`` on exit, its marks
(``mark(code)``: callbacks for autograd and DDP) note ``code``, its relays (``relay(code, extra,
first)``: the hook-free gradient wait's first autograd callback) call ``first()`` and note ``code``
with ``extra``, and ``step()`` notes the end of a step. An exception raised by ``clock`` or ``put`` is handed to ``on_error`` (which counts it) and
goes no further. Unbound, every call does nothing: the API before ``init()``.

The classes here are the reference. ``_cnotes.c`` implements the same four in C, because after
a backward pass the interpreter's caches are cold and each Python frame here costs 1-3 us, and
this module uses them when they were built and ``SYNCWATCH_PURE_PYTHON`` is not set
(``IMPLEMENTATION`` says which runs); the tests hold both to the same behaviour. The methods
below repeat the same few lines instead of calling a shared helper: a helper would be one more
Python frame per call here.
"""

from __future__ import annotations

import os


class Notes:
    """``Notes(step_code, wall)``: where the training thread's calls note entries; ``wall()``
    gives a step's wall-clock end (``time.time``)."""

    __slots__ = ("_to", "_step_code", "_wall")

    def __init__(self, step_code, wall):
        if not callable(wall):
            raise TypeError("Notes: wall must be callable")
        self._to = None  # (put, clock, on_error): one attribute, so a rebind is seen whole
        self._step_code = step_code
        self._wall = wall

    def bind(self, put=None, clock=None, on_error=None) -> None:
        """Report to ``put``/``clock``/``on_error``; without ``put``, unbind."""
        if put is None:
            self._to = None
        elif callable(put) and callable(clock) and callable(on_error):
            self._to = (put, clock, on_error)
        else:
            raise TypeError("bind: put, clock and on_error must be callable")

    @property
    def bound(self) -> bool:
        return self._to is not None

    def step(self, samples=0, tokens=None, step=None) -> None:
        """End a step that processed ``samples`` (and ``tokens``); ``step`` = the job's own step
        number (default: the previous one + 1)."""
        to = self._to
        if to is not None:
            try:
                to[0]((self._step_code, to[1](), self._wall(), samples, tokens, step))
            except Exception as e:
                to[2](e)

    def phase(self, start, end) -> Phase:
        """A context manager noting ``start`` on entry and ``end`` on exit."""
        return Phase(self, start, end)

    def mark(self, code) -> Mark:
        """A callable (any arguments, ignored) noting ``code``."""
        return Mark(self, code)

    def relay(self, code, extra, first) -> Relay:
        """A callable (any arguments, ignored) that calls ``first()``, then notes ``code`` with
        ``extra``: ``(code, mark, extra)``. If ``first`` raises, nothing is noted."""
        if not callable(first):
            raise TypeError("relay: first must be callable")
        return Relay(self, code, extra, first)


class Phase:
    """A phase's context manager. Stateless: one object serves nested and repeated uses."""

    __slots__ = ("_notes", "_start", "_end")

    def __init__(self, notes: Notes, start, end):
        self._notes, self._start, self._end = notes, start, end

    def __enter__(self):
        to = self._notes._to
        if to is not None:
            try:
                to[0]((self._start, to[1]()))
            except Exception as e:
                to[2](e)
        return self

    def __exit__(self, exc_type, exc, tb):
        to = self._notes._to
        if to is not None:
            try:
                to[0]((self._end, to[1]()))
            except Exception as e:
                to[2](e)
        return False  # never swallow the training code's exceptions


class Mark:
    """A callback noting its code; its arguments are ignored."""

    __slots__ = ("_notes", "_code")

    def __init__(self, notes: Notes, code):
        self._notes, self._code = notes, code

    def __call__(self, *args, **kwargs) -> None:
        to = self._notes._to
        if to is not None:
            try:
                to[0]((self._code, to[1]()))
            except Exception as e:
                to[2](e)


class Relay:
    """A callback that calls ``first`` and notes its code and ``extra``; arguments ignored."""

    __slots__ = ("_notes", "_code", "_extra", "_first")

    def __init__(self, notes: Notes, code, extra, first):
        self._notes, self._code, self._extra, self._first = notes, code, extra, first

    def __call__(self, *args, **kwargs) -> None:
        to = self._notes._to
        if to is not None:
            try:
                self._first()
                to[0]((self._code, to[1](), self._extra))
            except Exception as e:
                to[2](e)


PyNotes = Notes
IMPLEMENTATION = "Python"
if not os.environ.get("SYNCWATCH_PURE_PYTHON"):  # set: these classes, to compare or debug
    try:
        from ._cnotes import Notes  # noqa: F811  the same, in C
        IMPLEMENTATION = "C"
    except ImportError:
        pass
