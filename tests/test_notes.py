"""The training thread's notes: the pure-Python reference and the C classes behave the same."""

import collections
import gc
import glob
import itertools
import os
import random
import shutil
import subprocess
import sys
import threading
import tomllib
import weakref
import zipfile

import pytest

from syncwatch.instrument import notes

try:
    from syncwatch.instrument import _cnotes
except ImportError:
    _cnotes = None

IMPLEMENTATIONS = [pytest.param(notes.PyNotes, id="python"),
                   pytest.param(_cnotes.Notes if _cnotes else None, id="c", marks=pytest.mark.skipif(
                       _cnotes is None, reason="syncwatch.instrument._cnotes was not built"))]
STEP, READY, DONE = 16, 17, 18


def test_the_c_notes_are_built_and_used():
    if os.environ.get("SYNCWATCH_PURE_PYTHON"):
        assert notes.IMPLEMENTATION == "Python"
        pytest.skip("SYNCWATCH_PURE_PYTHON is set")
    assert _cnotes is not None, ("the C notes were not built: install with a C compiler and "
                                 "Python's headers, or set SYNCWATCH_PURE_PYTHON=1")
    assert notes.IMPLEMENTATION == "C" and notes.Notes is _cnotes.Notes


def bound(Notes):
    """Notes bound to a fresh deque, a counting clock and an error list."""
    n = Notes(STEP, itertools.count(1000).__next__)
    entries, errors = collections.deque(), []
    n.bind(entries.append, itertools.count().__next__, errors.append)
    return n, entries, errors


def script(n):
    """A step's calls in every form the API allows; returns what the body saw."""
    seen = []
    data, fwd = n.phase(0, 8), n.phase(1, 9)
    with data as d:
        seen.append(d is data)
    with fwd:
        with data:  # nested and reused: the objects are stateless
            pass
    done = n.mark(DONE)
    done()
    done("a future", key="ignored")
    firsts = []
    ready = n.relay(READY, 3, lambda: firsts.append(len(firsts)))
    ready()
    ready("ignored", too=1)
    seen.append(firsts)
    n.step()
    n.step(32)
    n.step(32.5, 100)
    n.step(8, tokens=7, step=12)
    n.step(samples=4, step=3)
    return seen


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_each_call_notes_one_entry_with_its_code_and_a_mark(Notes):
    n, entries, errors = bound(Notes)
    assert script(n) == [True, [0, 1]]  # each relay's first() ran before it noted
    assert list(entries) == [
        (0, 0), (8, 1), (1, 2), (0, 3), (8, 4), (9, 5), (DONE, 6), (DONE, 7),
        (READY, 8, 3), (READY, 9, 3),
        (STEP, 10, 1000, 0, None, None), (STEP, 11, 1001, 32, None, None),
        (STEP, 12, 1002, 32.5, 100, None), (STEP, 13, 1003, 8, 7, 12),
        (STEP, 14, 1004, 4, None, 3)]
    assert errors == []


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_unbound_notes_do_nothing(Notes):
    n = Notes(STEP, lambda: 1 / 0)  # not even the wall clock is read
    assert not n.bound
    assert script(n) == [True, []]  # nor a relay's first()
    entries = collections.deque()
    n.bind(entries.append, itertools.count().__next__, print)
    assert n.bound
    n.bind()
    assert not n.bound
    script(n)
    assert not entries


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_an_exception_in_put_or_clock_goes_to_on_error_not_to_the_caller(Notes):
    n, entries, errors = bound(Notes)

    def broken_put(entry):
        raise RuntimeError("put")
    n.bind(broken_put, itertools.count().__next__, errors.append)
    p = n.phase(0, 8)
    with p:
        pass
    n.step(1)
    n.mark(DONE)()
    n.relay(READY, 1, list)()
    assert [str(e) for e in errors] == ["put"] * 5
    assert errors[0].__traceback__ is not None  # logged with where it came from

    def broken_first():
        raise OSError("first")
    errors.clear()
    n.bind(entries.append, itertools.count().__next__, errors.append)
    n.relay(READY, 1, broken_first)()  # what it relays failed: nothing is noted
    assert [str(e) for e in errors] == ["first"] and not entries

    def broken_clock():
        raise ValueError("clock")
    errors.clear()
    n.bind(entries.append, broken_clock, errors.append)
    with p:
        pass
    n.step(1)
    n.relay(READY, 1, list)()
    assert [type(e) for e in errors] == [ValueError] * 4 and not entries


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_the_training_codes_exceptions_pass_through_a_phase(Notes):
    n, entries, errors = bound(Notes)
    with pytest.raises(ZeroDivisionError):
        with n.phase(2, 10):
            1 / 0
    assert [e[0] for e in entries] == [2, 10] and errors == []


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_keyboard_interrupt_is_not_swallowed(Notes):
    n, entries, errors = bound(Notes)

    def interrupted(entry):
        raise KeyboardInterrupt
    n.bind(interrupted, itertools.count().__next__, errors.append)
    with pytest.raises(KeyboardInterrupt):
        n.step(1)
    with pytest.raises(KeyboardInterrupt):
        with n.phase(0, 8):
            pass
    assert errors == []


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_step_rejects_arguments_it_does_not_take(Notes):
    n, entries, _ = bound(Notes)
    with pytest.raises(TypeError, match="argument"):
        n.step(1, 2, 3, 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sample'"):
        n.step(sample=1)
    with pytest.raises(TypeError, match="multiple values for argument 'samples'"):
        n.step(1, samples=2)
    with pytest.raises(TypeError, match="callable"):
        n.bind(entries.append, None, print)
    with pytest.raises(TypeError, match="callable"):
        Notes(STEP, None)
    with pytest.raises(TypeError, match="first must be callable"):
        n.relay(READY, 1, None)
    assert not entries


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_phase_mark_and_relay_take_their_arguments_by_keyword_too(Notes):
    n, entries, errors = bound(Notes)
    with n.phase(start=0, end=8):
        pass
    n.mark(code=DONE)()
    n.relay(code=READY, extra=3, first=list)()
    n.phase(0, end=8).__enter__()
    assert list(entries) == [(0, 0), (8, 1), (DONE, 2), (READY, 3, 3), (0, 4)] and errors == []
    with pytest.raises(TypeError):
        n.phase(0, 8, 9)
    with pytest.raises(TypeError):
        n.phase(0, begin=8)
    with pytest.raises(TypeError):
        n.mark()
    with pytest.raises(TypeError):
        n.relay(READY, 3)
    assert len(entries) == 5


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_a_phase_exit_takes_the_three_arguments_of_a_with_statement(Notes):
    n, entries, errors = bound(Notes)
    p = n.phase(0, 8)
    for args in ((), (None, None), (None, None, None, None)):
        with pytest.raises(TypeError):
            p.__exit__(*args)
    assert not entries and errors == []  # a misused exit notes nothing
    assert p.__exit__(None, None, None) is False and list(entries) == [(8, 0)]


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_no_reference_is_leaked(Notes):
    code, mark, samples = object(), object(), object()
    n = Notes(code, lambda: 0)
    sink = collections.deque(maxlen=1)

    def clock():
        return mark
    n.bind(sink.append, clock, print)
    binding = weakref.ref(clock)  # held by the binding, which each call holds while it runs
    p, m, r = n.phase(code, code), n.mark(code), n.relay(code, samples, lambda: samples)
    before = [sys.getrefcount(o) for o in (code, mark, samples)]
    for _ in range(1000):
        with p:
            pass
        m(samples)
        r(samples)
        n.step(samples, samples, samples)
    sink.clear()
    assert [sys.getrefcount(o) for o in (code, mark, samples)] == before
    n.bind()  # unbound: once each call let go of the binding, nothing holds it
    del clock
    assert binding() is None  # a leaked binding kept the monitor's put and on_error (itself)


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_a_monitor_and_its_notes_are_collected_together(Notes):
    class Owner:  # like the Monitor: it holds its notes, whose on_error is its method
        def __init__(self):
            self.notes = Notes(STEP, lambda: 0)
            self.entries = collections.deque()
            self.notes.bind(self.entries.append, lambda: 0, self.error)
            self.phase, self.done = self.notes.phase(0, 8), self.notes.mark(DONE)
            self.ready = self.notes.relay(READY, 1, self.done)  # as the gradient hooks build it

        def error(self, exc):
            pass
    owner = Owner()
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_a_rebind_on_another_thread_is_seen_whole(Notes):
    """The records thread (shutdown) and the API (set_monitor) rebind while the training thread
    notes: every entry lands whole in one of the bound deques, none fails."""
    n = Notes(STEP, lambda: 0)
    a, b, errors = collections.deque(), collections.deque(), []
    bindings = [(a.append, itertools.count().__next__, errors.append),
                (b.append, itertools.count().__next__, errors.append), ()]
    stop = threading.Event()
    rebinds = [0]
    rng = random.Random(0)  # not in turn: a thread switched out every third bind left none bound

    def rebind():
        for i in itertools.count():
            if stop.is_set():
                return
            n.bind(*rng.choice(bindings))
            rebinds[0] = i + 1
    n.bind(*bindings[0])
    t = threading.Thread(target=rebind)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t.start()
    try:
        p, calls = n.phase(0, 8), 0
        # however the threads get scheduled: on a loaded machine the training thread may hold
        # the interpreter only a few times, each time maybe unbound (one binding in three)
        while calls < 20000 or rebinds[0] < 1000 or not (a or b):
            with p:
                pass
            n.step(1)
            calls += 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert errors == [] and len(a) + len(b) > 0
    assert all(e[0] in (0, 8) and len(e) == 2 or e[0] == STEP and len(e) == 6
               for e in itertools.chain(a, b))


def test_an_install_without_a_c_compiler_falls_back_to_the_python_notes(tmp_path):
    """The C part is optional: a build whose compiler fails still gives a working package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "src"  # the sources only: not the extension built in place for the tests
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(root, name), src / name)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:  # what the wheel installs beside
        data_files = tomllib.load(f)["tool"]["setuptools"]["data-files"]
    for pattern in (p for patterns in data_files.values() for p in patterns):
        for path in glob.glob(pattern, root_dir=root):
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(root, path), src / path)
    shutil.copytree(os.path.join(root, "exporter"), src / "exporter",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    env = dict(os.environ, CC="/bin/false")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path / "wheel"), str(src)],
                   env=env, check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("syncwatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert "syncwatch/instrument/notes.py" in names
    assert not [n for n in names if n.endswith(".so")]
    env = {k: v for k, v in os.environ.items() if k != "SYNCWATCH_PURE_PYTHON"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c",
                          "import syncwatch.instrument as sw, syncwatch.instrument.notes as n\n"
                          "with sw.phase('data'):\n    sw.step(1)\n"
                          "print(n.IMPLEMENTATION, n.Notes.__module__)"],
                         env=env, check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["Python", "syncwatch.instrument.notes"]


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_notes_whose_init_never_ran_report_an_error_instead_of_crashing(Notes):
    n = Notes.__new__(Notes)
    errors = []
    n.bind(collections.deque().append, itertools.count().__next__, errors.append)
    n.step(1)  # counted as an internal error, like any other
    assert [type(e) for e in errors] in ([TypeError], [AttributeError])


@pytest.mark.parametrize("Notes", IMPLEMENTATIONS)
def test_init_again_unbinds(Notes):
    n, entries, errors = bound(Notes)
    n.__init__(STEP, lambda: 0)  # notes.py's __init__ sets _to = None
    assert not n.bound
    n.step(1)
    assert not entries
