"""The shared Prometheus HTTP API client: answers, and one clear error a way of failing.

The failures a real Prometheus cannot be made to produce (a proxy's HTML error page, a 200 that is
not JSON, a connection cut mid-answer) come from a loopback HTTP server that answers as such a
server would; the rest run against a real Prometheus.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from analysis_helpers import run_cli
from syncwatch import promapi
from syncwatch.stack import Prometheus, StackError


class _Canned(ThreadingHTTPServer):
    """Answers every request with ``self.answer`` = (status, content type, body) after ``self.delay``
    seconds; records requests and their Authorization headers."""

    def __init__(self):
        self.answer = (200, "application/json", b"{}")
        self.delay = 0.0
        self.requests: list[tuple[str, str, dict]] = []
        self.authorization: list[str | None] = []
        super().__init__(("127.0.0.1", 0), _CannedHandler)


class _CannedHandler(BaseHTTPRequestHandler):
    def _serve(self):
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode()) if length else {}
        url = urlsplit(self.path)
        self.server.requests.append((self.command, url.path, {**parse_qs(url.query), **form}))
        self.server.authorization.append(self.headers.get("Authorization"))
        time.sleep(self.server.delay)
        status, ctype, body = self.server.answer
        if status is None:  # cut the connection without answering
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _serve

    def log_message(self, *args):
        pass


@pytest.fixture
def canned():
    srv = _Canned()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, promapi.Client(f"http://127.0.0.1:{srv.server_address[1]}/", timeout=5)
    srv.shutdown()
    srv.server_close()


def _json(status: int, obj: dict) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


def test_query_endpoints_are_posted_others_got_and_none_params_dropped(canned):
    srv, client = canned
    srv.answer = _json(200, {"status": "success", "data": {"resultType": "vector", "result": []}})
    assert client.api("query", query="up", time=None) == {"resultType": "vector", "result": []}
    client.api("query_range", query="up", start="1", end="2", step="1")
    client.api("targets", state="active")
    client.api("rules")
    assert srv.requests == [("POST", "/api/v1/query", {"query": ["up"]}),
                            ("POST", "/api/v1/query_range",
                             {"query": ["up"], "start": ["1"], "end": ["2"], "step": ["1"]}),
                            ("GET", "/api/v1/targets", {"state": ["active"]}),
                            ("GET", "/api/v1/rules", {})]


def test_http_error_carries_prometheus_error_text(canned):
    srv, client = canned
    srv.answer = _json(400, {"status": "error", "errorType": "bad_data", "error": "1:5: parse error"})
    with pytest.raises(promapi.HTTPStatusError) as err:
        client.api("query", query="sum(")
    assert err.value.code == 400 and err.value.detail == "bad_data: 1:5: parse error"
    assert str(err.value) == (f"Prometheus at {client.url} answered HTTP 400 to /api/v1/query: "
                              "bad_data: 1:5: parse error")


def test_http_error_from_something_else_shows_the_start_of_its_body(canned):
    srv, client = canned
    srv.answer = (502, "text/html", b"<html>Bad Gateway</html>" + b"x" * 1000)
    with pytest.raises(promapi.HTTPStatusError, match=r"HTTP 502 to /api/v1/targets: <html>Bad Gateway") as err:
        client.api("targets", state="any")
    assert len(err.value.detail) == 200 and "?" not in str(err.value)


def test_http_error_page_over_many_lines_is_shown_on_one(canned):
    """``--prometheus`` pointing at another web server: its HTML error page came out line by line
    after ``syncwatch diagnose: error:``, not the one line the docs promise."""
    srv, client = canned
    srv.answer = (501, "text/html", b"<!DOCTYPE HTML>\n<html lang=\"en\">\n    <head>\n        <title>Error response</title>")
    with pytest.raises(promapi.HTTPStatusError) as err:
        client.api("query", query="up")
    assert err.value.detail == '<!DOCTYPE HTML> <html lang="en"> <head> <title>Error response</title>'


@pytest.mark.parametrize("answer", [(200, "text/html", b"<html>Grafana</html>"),
                                    (200, "application/json", b"[1, 2]"),
                                    (200, "application/json", b'{"data": {}}')])
def test_an_answer_that_is_not_prometheus_json_is_a_bad_response(canned, answer):
    srv, client = canned
    srv.answer = answer
    with pytest.raises(promapi.BadResponse, match=r"did not answer with Prometheus JSON \(is it Prometheus\?\)"):
        client.api("query", query="up")


def test_a_200_with_status_error_names_the_endpoint_and_error(canned):
    srv, client = canned
    srv.answer = _json(200, {"status": "error", "errorType": "timeout", "error": "query timed out"})
    with pytest.raises(promapi.PrometheusError,
                       match=r"failed /api/v1/query_range: timeout: query timed out"):
        client.api("query_range", query="up", start=1, end=2, step=1)


def test_warnings_of_a_partial_answer_are_kept_not_dropped(canned):
    """Thanos and Mimir answer "success" with ``warnings`` where a store did not answer (a
    partial response); the client returned the data and dropped them, so nothing downstream could
    say its figures missed series. Each distinct warning is kept, in order, and the data returned."""
    srv, client = canned
    partial = "No StoreAPIs matched for this query"
    srv.answer = _json(200, {"status": "success", "warnings": [partial, "store 10.0.0.7:10901: timeout"],
                             "data": {"resultType": "vector", "result": []}})
    assert client.api("query", query="up") == {"resultType": "vector", "result": []}
    srv.answer = _json(200, {"status": "success", "warnings": [partial], "data": {"resultType": "matrix",
                                                                                 "result": []}})
    client.api("query_range", query="up", start=1, end=2, step=1)
    assert client.warnings == [partial, "store 10.0.0.7:10901: timeout"]


def test_connection_cut_without_an_answer_is_unreachable(canned):
    srv, client = canned
    srv.answer = (None, "", b"")
    with pytest.raises(promapi.Unreachable, match=f"Prometheus unreachable at {client.url}"):
        client.api("query", query="up")


def test_closed_port_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    with pytest.raises(promapi.Unreachable, match=rf"Prometheus unreachable at http://127.0.0.1:{port}: .*refused"):
        promapi.Client(f"http://127.0.0.1:{port}", timeout=5).api("query", query="up")


def test_a_slow_answer_is_a_timeout_not_unreachable(canned):
    """A Prometheus that answered after the timeout was reported as "Prometheus unreachable"."""
    srv, _ = canned
    srv.delay = 1.0
    client = promapi.Client(f"http://127.0.0.1:{srv.server_address[1]}", timeout=0.2)
    with pytest.raises(promapi.TimedOut, match=rf"^Prometheus at {client.url} did not answer within 0.2 s$"):
        client.api("query", query="up")


def test_bearer_token_and_basic_auth_are_sent(canned):
    srv, _ = canned
    srv.answer = _json(200, {"status": "success", "data": {}})
    base = f"127.0.0.1:{srv.server_address[1]}"
    promapi.Client(f"http://{base}", 5, bearer_token="tok").api("targets")
    promapi.Client(f"http://{base}", 5, basic_auth=("ann", "pa:ss")).api("targets")
    promapi.Client(f"http://{base}").api("targets")
    assert srv.authorization == ["Bearer tok", "Basic YW5uOnBhOnNz", None]   # base64("ann:pa:ss")


def test_credentials_in_the_url_are_basic_auth_and_kept_out_of_messages(canned):
    """``http://user:pass@host`` was sent as a host name "user:pass@host" ("Name or service not
    known"), the password printed in the message."""
    srv, _ = canned
    srv.answer = (401, "text/plain", b"Unauthorized")
    client = promapi.Client(f"http://ann:pa%40ss@127.0.0.1:{srv.server_address[1]}/prom/")
    assert client.url == f"http://127.0.0.1:{srv.server_address[1]}/prom"
    with pytest.raises(promapi.HTTPStatusError, match="HTTP 401 to /api/v1/query: Unauthorized") as err:
        client.api("query", query="up")
    assert err.value.code == 401 and "pa@ss" not in str(err.value) and "ann" not in str(err.value)
    assert srv.authorization == ["Basic YW5uOnBhQHNz"]   # base64("ann:pa@ss")
    with pytest.raises(promapi.PrometheusError, match="give them once"):
        promapi.Client("http://ann:x@127.0.0.1:9", bearer_token="tok")


@pytest.mark.parametrize("url, message", [
    ("http://[::1", "not a valid URL (Invalid IPv6 URL)"),          # a ValueError traceback
    ("http://127.0.0.1:99999", "not a valid URL (Port out of range"),
    ("http://127.0.0.1:9090?x=1", "takes no ?query or #fragment"),  # answered "HTTP 405"
    ("http://127.0.0.1:9090/#top", "takes no ?query or #fragment"),
])
def test_a_malformed_prometheus_url_is_one_clear_line(url, message, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", url, "--job", "j"])
    assert code == 2 and not out and len(err.splitlines()) == 1 and message in err, err


def test_analysis_flags_send_a_token_and_the_errors_say_what_to_change(canned, tmp_path, monkeypatch, capsys):
    """The analysis commands had a fixed 30 s timeout, reported a slow Prometheus as
    "unreachable", and could send no credentials."""
    srv, client = canned
    token, empty = tmp_path / "token", tmp_path / "empty"
    token.write_text("tok\n")
    empty.write_text("\n")

    def diagnose(*flags: str) -> str:
        code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", client.url, "--job", "j", *flags])
        assert code == 2 and not out and len(err.splitlines()) == 1
        return err.removeprefix("syncwatch diagnose: error: ").rstrip("\n")

    srv.answer = (403, "text/plain", b"Forbidden")
    assert diagnose("--prometheus-bearer-token-file", str(token)) == (
        f"Prometheus at {client.url} answered HTTP 403 to /api/v1/query: Forbidden; "
        "the credentials given are not allowed this request")
    assert srv.authorization == ["Bearer tok"]
    assert diagnose().endswith("Forbidden; access is refused without credentials: give "
                               "--prometheus-bearer-token-file, or --prometheus-basic-auth-user with "
                               "--prometheus-basic-auth-password-file")
    srv.answer = _json(200, {"status": "success", "data": {"resultType": "vector", "result": []}})
    srv.delay = 1.0
    assert diagnose("--prometheus-timeout", "0.2") == (
        f"Prometheus at {client.url} did not answer within 0.2 s; a slow query over a long range may need "
        "a longer --prometheus-timeout")
    srv.delay = 0.0
    assert diagnose("--prometheus-bearer-token-file", str(empty)) == f"--prometheus-bearer-token-file {empty} is empty"
    assert diagnose("--prometheus-bearer-token-file", str(tmp_path / "nope")) == (
        f"cannot read --prometheus-bearer-token-file {tmp_path / 'nope'}: No such file or directory")
    assert diagnose("--prometheus-bearer-token-file", str(token), "--prometheus-basic-auth-user", "ann",
                    "--prometheus-basic-auth-password-file", str(token)) == (
        "give either --prometheus-bearer-token-file or basic auth, not both")
    for bad in ("0", "nan", "-1"):
        assert diagnose("--prometheus-timeout", bad).startswith("--prometheus-timeout must be a positive number")
    assert len(srv.requests) == 3   # the invalid flags were refused before asking Prometheus


def test_a_url_that_is_no_prometheus_api_says_what_to_give(canned, monkeypatch, capsys):
    """--prometheus pointed at a node daemon (the demo prints its scrape URLs) or given with
    /api/v1 appended read "answered HTTP 404 to /api/v1/query: 404: Not Found", which did not
    say that the URL was the wrong one, nor which URL to give."""
    srv, client = canned
    srv.answer = (404, "text/plain", b"404: Not Found")
    for url in (client.url, client.url + "/metrics", client.url + "/api/v1"):
        code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", url, "--job", "j"])
        assert code == 2 and not out and len(err.splitlines()) == 1, err
        assert err == (f"syncwatch diagnose: error: Prometheus at {url} answered HTTP 404 to /api/v1/query: "
                       "404: Not Found; there is no Prometheus API at that URL: --prometheus takes "
                       "Prometheus' base URL (e.g. http://127.0.0.1:9090, with its route prefix if it has "
                       "one), not a node daemon's /metrics nor a path under /api/v1\n")


def test_a_url_without_scheme_is_refused_up_front():
    with pytest.raises(promapi.PrometheusError, match="'127.0.0.1:9090': expected an http:// or https:// URL"):
        promapi.Client("127.0.0.1:9090")


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus missing (Debian package: prometheus)")
def test_against_real_prometheus():
    with Prometheus() as prom:
        client = promapi.Client(prom.url, timeout=10)
        assert client.api("query", query="vector(2)", time="1700000000.000")["result"] == [
            {"metric": {}, "value": [1700000000, "2"]}]
        with pytest.raises(promapi.HTTPStatusError) as err:
            client.api("query", query="sum(")
        assert err.value.code == 400 and err.value.detail.startswith("bad_data: ") and "parse error" in err.value.detail
        prom.config["global"]["scrape_interval"] = "2s"
        prom.reload()
        assert client.api("status/config")["yaml"].count("scrape_interval: 2s") == 1
    with pytest.raises(StackError, match="Prometheus unreachable"):
        prom.value("up")


@pytest.mark.parametrize("body", [
    {"status": "success"},                                                   # no data
    {"status": "success", "data": {}},                                       # no resultType
    {"status": "success", "data": {"resultType": "vector"}},                 # no result
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "x"]}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "1"]}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": 3}]}},
])
def test_a_success_answer_without_prometheus_data_is_one_clear_line(canned, body, monkeypatch, capsys):
    """A server answering "success" without a Prometheus result (another JSON API, a broken proxy)
    ended the analysis commands in a traceback (TypeError, KeyError, ValueError)."""
    srv, client = canned
    srv.answer = _json(200, body)
    code, out, err = run_cli(monkeypatch, capsys, ["diagnose", "--prometheus", client.url, "--job", "j"])
    assert code == 2 and not out and len(err.splitlines()) == 1, err
    assert err.startswith(f"syncwatch diagnose: error: {client.url} did not answer /api/v1/query with a "
                          "Prometheus result (is it Prometheus?)"), err
