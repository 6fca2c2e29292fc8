"""Grafana provisioning files in deploy/grafana/ agree with the generated dashboards."""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import ROOT

PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def _load(rel: str) -> dict:
    return yaml.safe_load((PROVISIONING / rel).read_text())


def test_datasource_is_the_default_prometheus_the_dashboards_select():
    cfg = _load("datasources/syncwatch.yml")
    assert cfg["apiVersion"] == 1
    (ds,) = cfg["datasources"]
    # Each dashboard's `datasource` variable lists datasources of type prometheus and starts on
    # the default one: this datasource.
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["access"] == "proxy" and ds["url"].startswith("http://")
    # Grafana derives $__rate_interval (4 x this) from it: it must be the shipped scrape interval.
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]


def test_dashboard_provider_reads_a_directory_of_files_and_keeps_ui_edits_out():
    cfg = _load("dashboards/syncwatch.yml")
    assert cfg["apiVersion"] == 1
    (provider,) = cfg["providers"]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    assert Path(provider["options"]["path"]).is_absolute()
    assert provider["folder"] == "syncwatch"
