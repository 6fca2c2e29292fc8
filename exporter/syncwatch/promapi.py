"""The one client for Prometheus' HTTP API (``/api/v1/...``), on urllib.

    client = Client("http://127.0.0.1:9090")
    client.api("query", query="up")  # the answer's data: {"resultType": "vector", "result": [...]}
    client.api("targets")            # {"activeTargets": [...], "droppedTargets": [...]}

Every failure is a ``PrometheusError`` whose message names the server and what went wrong, one
subclass a cause: ``Unreachable`` (refused, no route, cut off), ``TimedOut`` (no answer within the
timeout: the server may be up but slow), ``HTTPStatusError`` (Prometheus said no; its own ``error``
text, e.g. a PromQL parse error, is in the message; 401/403: credentials missing or refused) and
``BadResponse`` (an answer that is not Prometheus JSON: the URL points at something else).
``syncwatch.stack`` and ``syncwatch.analysis`` wrap it in their own error types.

An answer's ``warnings`` (a partial answer from Thanos or Mimir, where a store or querier
did not answer; Prometheus' own warnings) do not fail the request: the client keeps each one
once, in the order they came, in ``Client.warnings``, for the caller to report.

A Prometheus-compatible endpoint behind an authenticating proxy takes ``bearer_token`` or
``basic_auth=(user, password)``; credentials written in the URL (``https://user:pass@host``) are
basic auth too, and are left out of the URL that messages show.
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request


class PrometheusError(Exception):
    """Prometheus could not be asked, or did not answer a request."""


class Unreachable(PrometheusError):
    """No answer: connection refused, no route, or cut off."""


class TimedOut(PrometheusError):
    """No answer within the client's timeout (connecting or waiting for the answer)."""

    def __init__(self, message: str, timeout: float):
        super().__init__(message)
        self.timeout = timeout


class HTTPStatusError(PrometheusError):
    """Prometheus answered with an HTTP error; ``detail`` is its ``error`` text when it gave one."""

    def __init__(self, message: str, code: int, detail: str):
        super().__init__(message)
        self.code = code
        self.detail = detail


class BadResponse(PrometheusError):
    """The answer was not Prometheus' JSON envelope."""


class Client:
    """Requests against one Prometheus base URL (``http://host:port``, optionally with a path prefix)."""

    def __init__(self, url: str, timeout: float = 30.0, *, bearer_token: str | None = None,
                 basic_auth: tuple[str, str] | None = None):
        if not url.startswith(("http://", "https://")):
            raise PrometheusError(f"{url!r}: expected an http:// or https:// URL")
        if bearer_token is not None and basic_auth is not None:
            raise PrometheusError("give a bearer token or basic auth, not both")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # raises ValueError for a port that is not a number, or out of range
        except ValueError as e:  # "http://[::1" (Invalid IPv6 URL), a port out of range
            raise PrometheusError(f"{url!r}: not a valid URL ({e})") from None
        if parts.query or parts.fragment:  # the API paths are appended after them: HTTP 405
            raise PrometheusError(f"{url!r}: a Prometheus base URL takes no ?query or #fragment")
        if parts.username is not None:
            if bearer_token is not None or basic_auth is not None:
                raise PrometheusError("credentials both in the URL and given apart: give them once")
            basic_auth = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
            url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.authorization: str | None = None
        self.warnings: list[str] = []   # every distinct warning of the answers so far
        if bearer_token is not None:
            self.authorization = f"Bearer {bearer_token}"
        elif basic_auth is not None:
            pair = f"{basic_auth[0]}:{basic_auth[1]}".encode()
            self.authorization = "Basic " + base64.b64encode(pair).decode()

    def api(self, path: str, **params) -> object:
        """``/api/v1/<path>`` -> the answer's ``data``. Parameters that are None are left out.

        The query endpoints are asked with a form POST (Prometheus accepts it there), which keeps
        long PromQL out of URLs and access logs; every other endpoint with a GET.
        """
        params = {k: v for k, v in params.items() if v is not None}
        if path in _POST_ENDPOINTS:
            body = self.request(f"/api/v1/{path}", form=params)
        else:
            query = urllib.parse.urlencode(params)
            body = self.request(f"/api/v1/{path}" + (f"?{query}" if query else ""))
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "status" not in answer:
            raise BadResponse(f"{self.url} did not answer with Prometheus JSON (is it Prometheus?)")
        if answer["status"] != "success":
            raise PrometheusError(f"Prometheus at {self.url} failed /api/v1/{path}: {_error_text(answer)}")
        warnings = answer.get("warnings")
        for w in warnings if isinstance(warnings, list) else []:
            if str(w) not in self.warnings:
                self.warnings.append(str(w))
        return answer.get("data")

    def request(self, path: str, form: dict | None = None) -> bytes:
        """The body of ``GET path``, or of a form ``POST path`` when ``form`` is given (even empty)."""
        if form is None:
            req = urllib.request.Request(self.url + path, method="GET")
        else:
            req = urllib.request.Request(self.url + path, data=urllib.parse.urlencode(form).encode(),
                                         method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded"})
        if self.authorization:
            # not sent on to where a redirect points: that may be another host
            req.add_unredirected_header("Authorization", self.authorization)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = _http_error_detail(e)
            endpoint = path.split("?")[0]
            raise HTTPStatusError(f"Prometheus at {self.url} answered HTTP {e.code} to {endpoint}"
                                  + (f": {detail}" if detail else ""), e.code, detail) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            if isinstance(reason, TimeoutError):  # urlopen wraps a connect timeout in URLError
                raise TimedOut(f"Prometheus at {self.url} did not answer within {self.timeout:g} s",
                               self.timeout) from None
            raise Unreachable(f"Prometheus unreachable at {self.url}: {reason}") from None


_POST_ENDPOINTS = frozenset({"query", "query_range"})


def _error_text(answer: dict) -> str:
    kind, text = answer.get("errorType"), answer.get("error")
    if text:
        return f"{kind}: {text}" if kind else str(text)
    return str(answer)


def _http_error_detail(e: urllib.error.HTTPError) -> str:
    """Prometheus' own error text (``errorType: error``), else the start of whatever the body was,
    on one line (an HTML error page runs over many)."""
    try:
        raw = e.read()
    except (OSError, http.client.HTTPException):
        return ""
    try:
        answer = json.loads(raw)
    except ValueError:
        return " ".join(raw.decode(errors="replace").split())[:200]
    return _error_text(answer) if isinstance(answer, dict) else str(answer)[:200]
