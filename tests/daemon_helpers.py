"""Helpers for tests that talk to a real daemon: build records, send them, scrape and parse."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from syncwatch.protocol import PHASES, Cumulative, Encoder, Identity, SkewHistogram

WALL0 = 1_800_000_000.0  # a fixed, plausible unix time


def identity(rank=0, job="job-a", attempt=0, world=64, node="node-1", pid=None, local_rank=None,
             gpu=-1, uuid="", nonce=0):
    return Identity(train_job=job, attempt=attempt, rank=rank,
                    local_rank=rank % 8 if local_rank is None else local_rank, world_size=world,
                    node=node, pid=pid or 1000 + rank, gpu=gpu, gpu_uuid=uuid, nonce=nonce)


class RankSim:
    """One rank's cumulative counters, advanced step by step like the instrumentation would."""

    def __init__(self, ident: Identity, exact=True, tokens=False):
        self.enc = Encoder(ident)
        self.ident = ident
        self.exact = exact
        self.tokens = tokens
        self.totals = Cumulative()
        self.skew: SkewHistogram | None = None

    def step(self, step: int, step_seconds: float, wait_seconds: float = 0.001,
             phases: tuple[float, ...] | None = None, samples: float = 32.0, slack: float = 0.0,
             last_arrival: bool = False, checkpoint: bool = False, dropped: int | None = None,
             errors: int | None = None, skew: SkewHistogram | None = None,
             wall: float | None = None) -> bytes:
        phases = phases or tuple([step_seconds / len(PHASES)] * len(PHASES))
        t = self.totals
        self.totals = Cumulative(
            steps=t.steps + 1, step_seconds=t.step_seconds + step_seconds,
            phase_seconds=tuple(a + b for a, b in zip(t.phase_seconds, phases)),
            slack_seconds=t.slack_seconds + slack, last_arrivals=t.last_arrivals + int(last_arrival),
            samples=t.samples + samples, tokens=t.tokens + samples * 100,
            checkpoints=t.checkpoints + int(checkpoint),
            dropped_records=t.dropped_records if dropped is None else dropped,
            internal_errors=t.internal_errors if errors is None else errors)
        return self.enc.step(step, WALL0 + step if wall is None else wall, step_seconds,
                             wait_seconds, phases, step * 2, samples, samples * 100, self.totals,
                             exact=self.exact, has_tokens=self.tokens, skew=skew)


class Client:
    """A blocking Unix datagram client: a full daemon queue makes it wait, never lose a record."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.connect(path)
        self.count = 0

    def send(self, *datagrams: bytes) -> None:
        for d in datagrams:
            self.sock.send(d)
            self.count += 1

    def close(self) -> None:
        self.sock.close()


def healthz(url: str) -> dict:
    with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
        return json.load(r)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (robust on a loaded machine)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_records(url: str, handled: int, timeout: float = 10.0) -> dict:
    """Wait until the daemon has handled (accepted + rejected) ``handled`` records."""
    return wait_for(lambda: (h := healthz(url))["records"] + h["rejected"] >= handled and h,
                    timeout, f"{handled} records handled")


def scrape_text(url: str, accept: str = "text/plain") -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return r.read().decode()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of one text-format scrape."""
    out = {}
    for fam in text_string_to_metric_families(scrape_text(url)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))


def series_of(samples: dict, **labels) -> list:
    """Every sample whose labels include ``labels``."""
    want = {(k, str(v)) for k, v in labels.items()}
    return [k for k in samples if want <= set(k[1])]


def rss_of(pid: int) -> int:
    import psutil
    return psutil.Process(pid).memory_info().rss
