"""syncwatch Grafana dashboards as code (grafana-foundation-sdk); see docs/dashboards.md."""
