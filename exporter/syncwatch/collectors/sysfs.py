"""Safe reads of sysfs attribute files.

A sysfs attribute is a small regular file. The reader must survive what a real host (or a hostile
mount) puts in its place: a FIFO (opening it normally would block until a writer appears), a
device node, a file that vanished with its device, an attribute the driver refuses (``EINVAL`` for
the speed of a down link), or unparsable text. Every read is one ``os.open(O_NONBLOCK)``, an
``fstat`` check that the thing is a regular file, and one bounded ``os.read``.

A sysfs attribute whose driver callback itself blocks cannot be made non-blocking from user space;
that case is covered by the collector runner's per-call timeout (see ``base.CollectorRunner``).

Two outcomes besides a value:

* ``Absent``: nothing to report, quietly (missing or vanished file, ``EINVAL``/``ENODEV`` from the
  driver, InfiniBand's ``N/A (no PMA)``).
* ``Unreadable``: a real problem worth an error log (permission denied, not a regular file,
  garbage content). The message names the path.
"""

from __future__ import annotations

import errno
import os
import stat

MAX_BYTES = 4096  # sysfs attributes are at most one page

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
# errnos meaning "this attribute has no value right now" rather than "something is wrong"
_QUIET = {errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ENXIO, errno.EINVAL, errno.EOPNOTSUPP}


class Absent(Exception):
    """The attribute has no value here; drop its series without complaint."""


class Unreadable(Exception):
    """The attribute exists but cannot be read or parsed; drop its series and report."""


def read_text(path: str, limit: int = MAX_BYTES) -> str:
    """Return the stripped text of the regular file at ``path`` without ever blocking on open."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as e:
        raise _classify(path, e) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable(f"{path}: not a regular file")
        data = os.read(fd, limit)
    except OSError as e:
        raise _classify(path, e) from None
    finally:
        os.close(fd)
    return data.decode("ascii", "replace").strip()


def read_int(path: str) -> int:
    """Read a decimal integer attribute. ``N/A ...`` (no PMA on an IB port) counts as absent."""
    text = read_text(path)
    if text.startswith("N/A"):
        raise Absent(path)
    try:
        return int(text)
    except ValueError:
        raise Unreadable(f"{path}: not an integer: {text[:40]!r}") from None


def read_or_none(path: str, errors: list[str], read=read_int):
    """``read(path)``, or None: quietly where the file is absent, and with the reason appended to
    ``errors`` where it is unreadable (so one bad file drops only its own series)."""
    try:
        return read(path)
    except Absent:
        return None
    except Unreadable as e:
        errors.append(str(e))
        return None


def _classify(path: str, e: OSError) -> Exception:
    if e.errno in _QUIET:
        return Absent(path)
    return Unreadable(f"{path}: {os.strerror(e.errno) if e.errno else e}")


def label_value(name: str) -> str:
    """A directory entry name as a label value. Linux lets an interface name hold any byte but
    ``/``, ``:`` and white space; ``os.listdir`` hands bytes that are not UTF-8 over as lone
    surrogates, which the exposition cannot encode: one such name failed the whole scrape, rank
    metrics included. Such bytes are written as ``\\xNN`` instead (the path keeps the raw name)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def list_dir(path: str) -> list[str]:
    """Sorted entry names of a directory; an absent directory is an empty list."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise _classify(path, e) from None
