"""aiohttp app factory, the running daemon, and a thread wrapper for tests and the simulator.

The event loop only serves HTTP. Ingest runs in its own threads (ingest.py); ``/metrics`` renders
in a one-worker thread pool, so neither a slow render nor a burst of records waits on the other
more than the snapshot copy. The text format is served whenever the client accepts it (Prometheus
asks for OpenMetrics first but accepts text; the OpenMetrics encoder takes ~1.7x as long, at 8
to 512 ranks with prometheus_client 0.26, and its extras are unused here); OpenMetrics only to a
client that accepts nothing else. gzip at level 1 when accepted (the client library's level 9
costs ~20x more). A media type or coding of weight 0 (``q=0``, ``q=0.0``, ... ``q=0.000``; RFC
9110 12.4.2) is not accepted; prometheus_client's own ``gzip_accepted`` reads no weights at all.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from .. import __version__
from .config import DaemonConfig, parse_listen
from .exposition import GuardedRegistry, StateCollector
from .ingest import Ingest
from .state import State

log = logging.getLogger("syncwatch.daemon")

CONFIG = web.AppKey("config", DaemonConfig)
STATE = web.AppKey("state", State)
INGEST = web.AppKey("ingest", Ingest)
REGISTRY = web.AppKey("registry", GuardedRegistry)
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
# the render under way per (content type, gzip): scrapes that arrive meanwhile share it
RENDERING = web.AppKey("rendering", dict)

EXPIRE_EVERY = 1.0  # seconds between liveness sweeps (also done at every scrape)


_NOT_ACCEPTABLE = re.compile(r"q=0(\.0{0,3})?", re.IGNORECASE)
_VERSION = re.compile(r"(\d+(\.\d+)*)?")  # empty: none given


def _accepted(header: str) -> list[list[str]]:
    """The elements of an Accept or Accept-Encoding header, each as [value, *parameters], less
    those of weight 0: "not acceptable", however many zero decimals it is written with."""
    elements = []
    for part in header.split(","):
        fields = [f.strip() for f in part.split(";")]
        if fields[0] and not any(_NOT_ACCEPTABLE.fullmatch(f) for f in fields[1:]):
            elements.append(fields)
    return elements


def _encoder_accept(accept: str) -> str:
    """What ``choose_encoder`` is given: "" (the text format) unless the Accept header accepts
    media types and none of them is text/plain or */*; then the ones it accepts, less those whose
    version is not numbers (``choose_encoder`` compares the parts as numbers: ``version=1.x``
    raised, a 500), their types in lower case (``choose_encoder`` compares them as written)."""
    elements = [e for e in _accepted(accept)
                if all(_VERSION.fullmatch(f[8:]) for f in e[1:] if f.startswith("version="))]
    if not elements or any(e[0].lower() in ("text/plain", "*/*", "text/*") for e in elements):
        return ""
    return ",".join(";".join([e[0].lower(), *e[1:]]) for e in elements)


def _gzip_accepted(accept_encoding: str) -> bool:
    return any(e[0].lower() in ("gzip", "x-gzip") for e in _accepted(accept_encoding))


def render(registry: GuardedRegistry, accept: str, gzipped: bool) -> tuple[bytes, dict]:
    """Render the exposition for one scrape: (body, headers)."""
    encoder, content_type = choose_encoder(_encoder_accept(accept))
    body = encoder(registry)
    headers = {"Content-Type": content_type}
    if gzipped:
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return body, headers


async def _metrics(request: web.Request) -> web.Response:
    """A scrape that arrives while a render of the same format is under way gets that render.
    Renders queued one per request: scrapes their clients had given up on (Prometheus' timeout,
    a dashboard closed) still rendered one after another, and the next scrape waited behind all of
    them (40 abandoned scrapes of a 0.4 s render held the next one past Prometheus' 10 s timeout)."""
    app = request.app
    accept = request.headers.get("Accept", "")
    gzipped = _gzip_accepted(request.headers.get("Accept-Encoding", ""))
    key = (choose_encoder(_encoder_accept(accept))[1], gzipped)
    rendering = app[RENDERING]
    shared = rendering.get(key)
    if shared is None:
        shared = rendering[key] = asyncio.get_running_loop().run_in_executor(
            app[EXECUTOR], render, app[REGISTRY], accept, gzipped)
        shared.add_done_callback(lambda done: rendering.pop(key, None))
    body, headers = await asyncio.shield(shared)  # one client leaving cancels no one else's
    return web.Response(body=body, headers=headers)


async def _healthz(request: web.Request) -> web.Response:
    counts = request.app[STATE].counts()
    return web.json_response({"status": "ok", **counts})


async def _index(request: web.Request) -> web.Response:
    return web.Response(text=f"syncwatch daemon {__version__}: /metrics /healthz\n")


async def _ingest_ctx(app: web.Application):
    ingest = app[INGEST]
    ingest.start()  # raises IngestError with an operator-readable message
    yield
    await asyncio.get_running_loop().run_in_executor(None, ingest.stop)


async def _expire_ctx(app: web.Application):
    state, ingest = app[STATE], app[INGEST]

    async def sweep():
        while True:
            await asyncio.sleep(min(EXPIRE_EVERY, app[CONFIG].rank_ttl / 4))
            state.expire()
            ingest.flush_reject_log()

    task = asyncio.create_task(sweep())
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _collectors_ctx(extra: Sequence):
    async def ctx(app: web.Application):
        for c in extra:
            _call_guarded(c, "start")
        yield
        for c in extra:
            _call_guarded(c, "stop")
        app[EXECUTOR].shutdown(wait=True)
    return ctx


def _call_guarded(collector, method: str) -> None:
    fn = getattr(collector, method, None)
    if fn is None:
        return
    try:
        fn()
    except Exception:
        log.exception("collector %r: %s() failed", collector, method)


def create_app(config: DaemonConfig, extra_collectors: Sequence = ()) -> web.Application:
    """The daemon as an aiohttp application. Ingest sockets open at app startup."""
    app = web.Application()
    state = State(config)
    app[CONFIG] = config
    app[STATE] = state
    app[INGEST] = Ingest(state, config.socket, config.udp)
    app[REGISTRY] = GuardedRegistry([StateCollector(state), *extra_collectors])
    app[EXECUTOR] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncwatch-render")
    app[RENDERING] = {}
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/", _index)
    app.cleanup_ctx.append(_ingest_ctx)
    app.cleanup_ctx.append(_expire_ctx)
    app.cleanup_ctx.append(_collectors_ctx(tuple(extra_collectors)))
    return app


@dataclass
class RunningDaemon:
    port: int
    url: str
    socket_path: str | None
    udp_address: str | None
    app: web.Application = field(repr=False)
    _runner: web.AppRunner = field(repr=False)

    @property
    def state(self) -> State:
        return self.app[STATE]

    async def stop(self) -> None:
        await self._runner.cleanup()


async def start_daemon(config: DaemonConfig, extra_collectors: Sequence = ()) -> RunningDaemon:
    """Start the daemon on the running loop. Raises ``OSError`` (port taken, socket not bindable)."""
    host, port = parse_listen(config.listen)
    app = create_app(config, extra_collectors)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    actual = runner.addresses[0][1]
    url_host = f"[{host}]" if ":" in host else host
    return RunningDaemon(port=actual, url=f"http://{url_host}:{actual}", socket_path=config.socket,
                         udp_address=app[INGEST].udp_address, app=app, _runner=runner)


class DaemonThread:
    """Runs ``start_daemon`` on a private event loop in a background thread.

    ``with DaemonThread(config) as d:`` gives the running daemon's attributes (``port``, ``url``,
    ``socket_path``, ``udp_address``, ``state``) and stops it cleanly on exit.
    """

    def __init__(self, config: DaemonConfig, extra_collectors: Sequence = ()):
        self.config = config
        self.extra_collectors = tuple(extra_collectors)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._daemon: RunningDaemon | None = None

    def start(self) -> RunningDaemon:
        if self._daemon is not None:
            return self._daemon
        loop = asyncio.new_event_loop()
        started = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._daemon = loop.run_until_complete(
                    start_daemon(self.config, self.extra_collectors))
            except BaseException as e:
                error.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="syncwatch-daemon", daemon=True)
        self._thread.start()
        started.wait()
        if error:
            self._thread.join()
            self._thread = None
            raise error[0]
        return self._daemon

    def stop(self) -> None:
        if self._daemon is None:
            return
        asyncio.run_coroutine_threadsafe(self._daemon.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._daemon = self._thread = self._loop = None

    def __getattr__(self, name):
        # port, url, socket_path, udp_address, state, app of the running daemon
        daemon = self.__dict__.get("_daemon")
        if daemon is None:
            raise AttributeError(f"{name}: the daemon is not running")
        return getattr(daemon, name)

    def __enter__(self) -> "DaemonThread":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
