"""Hardware collectors inside the real daemon: a failing or hanging collector never fails or delays
a scrape, and ``syncwatch daemon`` runs the collectors its flags select."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter

from collector_helpers import FIXTURES, promtool_check
from conftest import subprocess_env
from daemon_helpers import scrape, scrape_text, value, wait_for
from syncwatch.collectors import CollectorRunner
from syncwatch.collectors.fake_nvml import FakeNvml
from syncwatch.collectors.gpu import GpuCollector
from syncwatch.collectors.infiniband import InfinibandCollector
from syncwatch.collectors.net import NetCollector
from syncwatch.daemon.app import DaemonThread
from syncwatch.daemon.config import DaemonConfig

CONGESTED = str(FIXTURES / "sysfs" / "congested")


class Broken:
    def update(self, errors):
        raise RuntimeError("collector bug")


class RaisesInCollect:
    """A raw extra collector (no runner) that raises at scrape time: the daemon's guard drops it."""

    def collect(self):
        raise RuntimeError("boom")


def timed_scrape(url: str) -> tuple[int, float]:
    start = time.monotonic()
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        r.read()
        return r.status, time.monotonic() - start


def test_failing_and_hanging_collectors_never_fail_or_delay_a_scrape():
    fake = FakeNvml()
    runner = CollectorRunner({"gpu": GpuCollector(nvml=fake), "broken": Broken(),
                              "net": NetCollector(CONGESTED), "infiniband": InfinibandCollector(CONGESTED)},
                             interval=0.05, timeout=0.2)
    config = DaemonConfig(listen="127.0.0.1:0", socket=None)
    with DaemonThread(config, extra_collectors=[runner, RaisesInCollect()]) as daemon:
        url = daemon.url
        ok = lambda name: value(scrape(url), "syncwatch_collector_success", collector=name)  # noqa: E731
        wait_for(lambda: ok("gpu") == 1 and ok("net") == 1, what="first collector cycle")
        gate = fake.hang("nvmlDeviceGetTemperature")
        try:
            wait_for(lambda: ok("gpu") == 0, what="hung GPU collector marked failed")
            for _ in range(5):  # warm up: the render pool and any lazily started server thread
                timed_scrape(url)
            threads = Counter(t.name for t in threading.enumerate())
            fds = len(os.listdir("/proc/self/fd"))
            worst = 0.0
            for _ in range(100):
                status, seconds = timed_scrape(url)
                assert status == 200
                worst = max(worst, seconds)
            assert worst < 2.0, f"slowest scrape {worst:.3f}s"
            grown = Counter(t.name for t in threading.enumerate()) - threads
            assert not grown, f"threads appeared during 100 scrapes: {grown}"
            # the server closes its side of the last connections asynchronously: let it settle
            wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds, 10, f"fd count back to {fds}")
            m = scrape(url)
            assert value(m, "syncwatch_collector_success", collector="broken") == 0
            assert value(m, "syncwatch_collector_success", collector="net") == 1
            assert value(m, "syncwatch_roce_cnp_sent_total", device="mlx5_1", port="1") == 8_812_004
            assert value(m, "syncwatch_ranks_active") == 0  # the daemon's own families are intact
            promtool_check(scrape_text(url))
        finally:
            gate.set()
        wait_for(lambda: ok("gpu") == 1, what="GPU collector recovery")
    assert not any(t.name.startswith("syncwatch-collector-") for t in threading.enumerate())


def _daemon_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "syncwatch", "daemon", "--listen", "127.0.0.1:0", "--socket", "",
            "--log-level", "error", *flags]


def _run_cli(*flags: str, **env: str) -> dict:
    """Start ``syncwatch daemon`` with ``flags``, scrape it once its collectors ran, stop it."""
    import psutil
    proc = subprocess.Popen(_daemon_cmd(*flags), env=subprocess_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = wait_for(lambda: proc.poll() is None and [
            c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == "LISTEN"],
            30, "daemon port")[0]
        url = f"http://127.0.0.1:{port}"
        return wait_for(lambda: (m := scrape(url)) and
                        value(m, "syncwatch_collector_duration_seconds", collector="net") is not None and m,
                        30, "a collector cycle")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode()


def test_cli_daemon_runs_the_selected_collectors():
    m = _run_cli("--path.sysfs", CONGESTED, "--collector.interval", "0.2")
    assert value(m, "syncwatch_roce_ecn_marked_total", device="mlx5_1", port="1") == 12_030_455
    assert value(m, "syncwatch_nic_speed_bytes", device="ens1f0np0") == 25e9
    assert value(m, "syncwatch_collector_success", collector="gpu") == 1
    if not nvml_present():  # NVML absent: the gpu collector runs quietly, without GPU series
        assert not [k for k in m if k[0].startswith("syncwatch_gpu_")]


def nvml_present() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_cli_daemon_flags_and_env_turn_collectors_off():
    m = _run_cli("--path.sysfs", CONGESTED, "--collector.interval", "0.2", "--no-collector.gpu",
                 SYNCWATCH_COLLECTOR_INFINIBAND="0")
    names = {dict(k[1]).get("collector") for k in m if k[0] == "syncwatch_collector_success"}
    assert names == {"net"}
    assert not [k for k in m if k[0].startswith("syncwatch_ib_") or k[0].startswith("syncwatch_roce_")]
