"""The analysis commands' view of Prometheus: query answers as ``Series`` keyed by label sets.

Requests go through ``syncwatch.promapi``; its errors become ``AnalysisError`` (exit code 2) with
the message naming the URL and what went wrong, so every command reports "Prometheus unreachable"
the same way; a timeout, an HTTP 401/403 and a 404 (no Prometheus API at the URL) also say which
flag to change. The answers' warnings
(partial answers) are kept in ``warnings`` for the commands to note.
"""

from __future__ import annotations

import contextlib
import math

from .. import promapi
from .common import AnalysisError

Series = dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]


_GIVE_CREDENTIALS = ("give --prometheus-bearer-token-file, or --prometheus-basic-auth-user with "
                     "--prometheus-basic-auth-password-file")


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0, *, bearer_token: str | None = None,
                 basic_auth: tuple[str, str] | None = None):
        try:
            self.client = promapi.Client(url, timeout, bearer_token=bearer_token, basic_auth=basic_auth)
        except promapi.PrometheusError as e:
            raise AnalysisError(f"--prometheus {e}") from None
        self.url = self.client.url

    def _data(self, path: str, **params) -> dict:
        try:
            return self.client.api(path, **params)
        except promapi.TimedOut as e:
            raise AnalysisError(f"{e}; a slow query over a long range may need a longer "
                                "--prometheus-timeout") from None
        except promapi.HTTPStatusError as e:
            raise AnalysisError(f"{e}{self._hint(e.code)}") from None
        except promapi.PrometheusError as e:
            raise AnalysisError(str(e)) from None

    @property
    def warnings(self) -> list[str]:
        """The distinct warnings of the answers so far (a partial answer, from Thanos or Mimir)."""
        return self.client.warnings

    def _hint(self, code: int) -> str:
        given = self.client.authorization is not None
        if code == 404:  # Prometheus answers every /api/v1 query path: the URL points elsewhere
            return ("; there is no Prometheus API at that URL: --prometheus takes Prometheus' base URL "
                    "(e.g. http://127.0.0.1:9090, with its route prefix if it has one), not a node "
                    "daemon's /metrics nor a path under /api/v1")
        if code == 401:
            return ("; the credentials given were not accepted" if given
                    else f"; it asks for credentials: {_GIVE_CREDENTIALS}")
        if code == 403:
            return ("; the credentials given are not allowed this request" if given
                    else f"; access is refused without credentials: {_GIVE_CREDENTIALS}")
        return ""

    def query(self, expr: str, time: float) -> Series:
        """Instant query: {labels: [(t, v)]} (one point per series)."""
        data = self._data("query", query=expr, time=f"{time:.3f}")
        with self._reading("query"):
            if data["resultType"] != "vector":
                raise AnalysisError(f"expected a vector from {expr!r}, got {data['resultType']}")
            return {_key(r["metric"]): [(float(r["value"][0]), _num(r["value"][1]))] for r in data["result"]}

    def samples(self, expr: str, time: float) -> Series:
        """The raw samples a range-vector selector (``metric{...}[10m]``) holds at ``time``."""
        data = self._data("query", query=expr, time=f"{time:.3f}")
        with self._reading("query"):
            if data["resultType"] != "matrix":
                raise AnalysisError(f"expected a matrix from {expr!r}, got {data['resultType']}")
            return {_key(r["metric"]): [(float(t), _num(v)) for t, v in r["values"]] for r in data["result"]}

    def query_range(self, expr: str, start: float, end: float, step: float) -> Series:
        """Range query at ``start``, ``start + step``, ... (times and step in whole milliseconds).

        The step goes as a duration in milliseconds: Prometheus reads a step in float seconds by
        truncating ``seconds * 1e9`` to nanoseconds, so ``16.002`` became 16.001 s and each
        answer's timestamp drifted one millisecond further from the windows asked for.

        ``nocache=1``: VictoriaMetrics otherwise moves the start down to a multiple of the step (to
        cache the answer), so every timestamp comes up to a step early; Prometheus ignores it.
        """
        data = self._data("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                          step=f"{max(1, round(step * 1000))}ms", nocache="1")
        with self._reading("query_range"):
            return {_key(r["metric"]): [(float(t), _num(v)) for t, v in r["values"]] for r in data["result"]}

    @contextlib.contextmanager
    def _reading(self, path: str):
        """Reading an answer's ``data``: one that is not a Prometheus result (a server answering
        "success" without ``data``, ``resultType`` or ``result``, or with values that are not
        numbers) is one clear line, not a TypeError, KeyError or ValueError traceback."""
        try:
            yield
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise AnalysisError(f"{self.url} did not answer /api/v1/{path} with a Prometheus result "
                                f"(is it Prometheus?): {type(e).__name__}: {e}") from None

    def scalar(self, expr: str, time: float, default: float | None = None) -> float | None:
        """The value of a one-series instant query (or ``default`` when it returns nothing)."""
        res = self.query(expr, time)
        if not res:
            return default
        v = next(iter(res.values()))[0][1]
        return v if math.isfinite(v) else default


def _key(metric: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(metric.items()))


def _num(v: str) -> float:
    return float(v)  # Prometheus sends "NaN", "+Inf" as strings; float() reads them


def label(key: tuple[tuple[str, str], ...], name: str) -> str | None:
    return dict(key).get(name)


def quote(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
