"""deploy/alertmanager/alertmanager.yml: valid, routes each severity, inhibits as documented."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest

from conftest import ROOT
from syncwatch.stack import Alertmanager, wait_until

CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool missing (Debian package: prometheus-alertmanager)")
AM_BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def _route(*labels: str) -> str:
    out = subprocess.run([AMTOOL, "config", "routes", "test", f"--config.file={CONFIG}", *labels],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_amtool
def test_amtool_check_config():
    out = subprocess.run([AMTOOL, "check-config", str(CONFIG)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_amtool
@pytest.mark.parametrize("labels,receiver", [
    (("severity=critical", "train_job=j1", "alertname=SyncwatchPersistentStraggler"), "pager"),
    (("severity=critical", "alertname=SyncwatchGpuLost", "instance=a:9477"), "pager"),
    (("severity=warning", "train_job=j1", "alertname=SyncwatchJobUnstable"), "queue"),
    (("severity=warning", "alertname=SyncwatchDaemonDown", "instance=a:9477"), "queue"),
    (("severity=info", "alertname=SyncwatchGpuThrottling"), "blackhole"),
    (("severity=info", "alertname=SyncwatchWatchdog"), "watchdog"),
    (("alertname=SomethingUnlabelled",), "queue"),
])
def test_amtool_routes_each_severity(labels, receiver):
    assert _route(*labels) == receiver


@pytest.mark.skipif(AM_BINARY is None, reason="Alertmanager missing (Debian package: prometheus-alertmanager)")
def test_stalled_job_inhibits_its_variance_alert_but_not_another_jobs_and_desync_its_stuck_start():
    def alert(name, job, severity):
        return {"labels": {"alertname": name, "train_job": job, "severity": severity},
                "annotations": {"summary": name}}

    with Alertmanager(CONFIG) as am:
        body = json.dumps([alert("SyncwatchJobStalled", "j1", "critical"),
                           alert("SyncwatchStepTimeVarianceGrowing", "j1", "critical"),
                           alert("SyncwatchStepTimeVarianceGrowing", "j2", "critical"),
                           alert("SyncwatchRankDesynchronized", "j3", "critical"),
                           alert("SyncwatchJobStuckAtStart", "j3", "critical")]).encode()
        req = urllib.request.Request(am.url + "/api/v2/alerts", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()

        def states():
            got = {(a["labels"]["alertname"], a["labels"]["train_job"]): a["status"]
                   for a in am.alerts()}
            inhibited = sum(bool(s["inhibitedBy"]) for s in got.values())
            return got if len(got) == 5 and inhibited == 2 else None

        got = wait_until(states, 15, what="alerts to be received and inhibition evaluated")
        assert got[("SyncwatchStepTimeVarianceGrowing", "j1")]["state"] == "suppressed"
        assert got[("SyncwatchStepTimeVarianceGrowing", "j1")]["inhibitedBy"]
        assert got[("SyncwatchStepTimeVarianceGrowing", "j2")]["state"] == "active"
        assert got[("SyncwatchJobStalled", "j1")]["state"] == "active"
        assert got[("SyncwatchJobStuckAtStart", "j3")]["state"] == "suppressed"
        assert got[("SyncwatchRankDesynchronized", "j3")]["state"] == "active"
