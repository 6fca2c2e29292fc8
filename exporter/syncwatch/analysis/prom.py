"""A small client for Prometheus' HTTP API (``/api/v1/query``, ``/api/v1/query_range``), on urllib.

Errors become ``AnalysisError`` with a message naming the URL and what went wrong, so every
command reports "Prometheus unreachable" the same way (exit code 2).
"""

from __future__ import annotations

import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request

from .common import AnalysisError

Series = dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise AnalysisError(f"--prometheus {url!r}: expected an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict) -> dict:
        query = urllib.parse.urlencode(params)
        req = urllib.request.Request(f"{self.url}{path}", data=query.encode(), method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            try:
                detail = json.load(e).get("error", "")
            except (ValueError, OSError):
                detail = ""
            raise AnalysisError(f"Prometheus at {self.url} answered HTTP {e.code}"
                                + (f": {detail}" if detail else "")) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise AnalysisError(f"Prometheus unreachable at {self.url}: {reason}") from None
        except ValueError:
            raise AnalysisError(f"{self.url} did not answer with Prometheus JSON (is it Prometheus?)") from None
        if body.get("status") != "success":
            raise AnalysisError(f"Prometheus query failed: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, time: float) -> Series:
        """Instant query: {labels: [(t, v)]} (one point per series)."""
        data = self._get("/api/v1/query", {"query": expr, "time": f"{time:.3f}"})
        if data["resultType"] != "vector":
            raise AnalysisError(f"expected a vector from {expr!r}, got {data['resultType']}")
        return {_key(r["metric"]): [(float(r["value"][0]), _num(r["value"][1]))] for r in data["result"]}

    def query_range(self, expr: str, start: float, end: float, step: float) -> Series:
        data = self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                 "end": f"{end:.3f}", "step": f"{step:.3f}"})
        return {_key(r["metric"]): [(float(t), _num(v)) for t, v in r["values"]] for r in data["result"]}

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
