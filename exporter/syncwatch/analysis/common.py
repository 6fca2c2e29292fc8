"""What every analysis command shares: the error that exits 2, output, number and time formats, small statistics."""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from typing import Any, Callable

EXIT_USAGE = 2


class AnalysisError(Exception):
    """A problem the user can fix (bad input, unreachable Prometheus, empty range): exit code 2."""


def command(name: str) -> Callable:
    """Wrap a command's ``run(args)``: print an ``AnalysisError`` as one clear line, exit 2; so too
    an ``OverflowError``, which only absurd magnitudes in the flags reach (``--latency-us 1e200``,
    a node count of 300 digits)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(args) -> int:
            try:
                return int(fn(args) or 0)
            except AnalysisError as e:
                print(f"syncwatch {name}: error: {e}", file=sys.stderr)
                return EXIT_USAGE
            except OverflowError as e:
                print(f"syncwatch {name}: error: a figure too large to compute with ({e}): check "
                      "the magnitudes of the flags", file=sys.stderr)
                return EXIT_USAGE
        return run
    return wrap


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=_json_default, allow_nan=False))


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def finite_or_none(x: float | None) -> float | None:
    """JSON has no infinity: an infinite or NaN figure is written as null."""
    return x if x is not None and math.isfinite(x) else None


_SI = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_QTY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGTPE]?)\s*")


def quantity(text: str | float | int) -> float:
    """``70e9``, ``70G``, ``1.37G``, ``2T`` -> float (SI suffixes k M G T P E)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = _QTY.fullmatch(str(text))
    if not m:
        raise ValueError(f"not a number: {text!r} (examples: 70e9, 70G, 1.5T)")
    return float(m.group(1)) * _SI.get(m.group(2), 1.0)


YEAR = 365.25 * 86400


def human_seconds(s: float | None) -> str:
    """``93784`` -> ``1d 2h 3m``; ``0.0274`` -> ``27.4 ms``; from ten years on ``2.3e+05 years``."""
    if s is None or not math.isfinite(s):
        return "never"
    if s >= 10 * YEAR:
        return f"{s / YEAR:.3g} years"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 60:
        return f"{s:.2f} s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {sec}s"


def plural(n: float, noun: str, fmt: str = "") -> str:
    """``n`` and its noun in agreement: ``1 rank``, ``4 ranks``, ``1 node``; ``fmt`` formats ``n``
    (``",.0f"``: ``1,024``), and a count that reads "1" once formatted takes the singular."""
    text = format(n, fmt)
    return f"{text} {noun if text == '1' else noun + 's'}"


def pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f} ms"


def lag1(xs: list[float], min_points: int = 3) -> float | None:
    """Lag-1 autocorrelation of ``xs`` (None with fewer than ``min_points`` or no variation)."""
    if len(xs) < min_points:
        return None
    m = sum(xs) / len(xs)
    den = sum((x - m) ** 2 for x in xs)
    if den == 0:
        return None
    return sum((a - m) * (b - m) for a, b in zip(xs, xs[1:])) / den


class Given:
    """Mixin for argparse actions: remember which destinations the command line set.

    A config file fills only what neither the command line nor an environment twin gave:
    precedence is flag > SYNCWATCH_* environment > config file > built-in default.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        given = set(getattr(namespace, "_given", ()))
        given.add(self.dest)
        namespace._given = given
        super().__call__(parser, namespace, values, option_string)


def tracked(action_cls):
    return type("Tracked" + action_cls.__name__, (Given, action_cls), {})
