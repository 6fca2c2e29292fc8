# syncwatch node daemon (and the simulator for `docker compose --profile demo up`).
#   docker build -t syncwatch:0.1.0 .
# Runs as an unprivileged user (65532); needs no capability. The ingest socket directory
# /run/syncwatch belongs to that user and its group, so a named volume mounted there starts with
# the right owner: training containers join group 65532 to send (docs/deploy.md).

FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# the configuration and rule files the package installs for `syncwatch stack up` (pyproject.toml)
COPY deploy/prometheus/prometheus.yml ./deploy/prometheus/
COPY deploy/alertmanager/alertmanager.yml ./deploy/alertmanager/
COPY alerts ./alerts
# Wheels of syncwatch and its dependencies; the runtime stage installs them offline.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11.13-slim-bookworm
RUN groupadd --system --gid 65532 syncwatch \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin syncwatch \
 && install -d -o 65532 -g 65532 -m 0750 /run/syncwatch
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels syncwatch \
 && rm -rf /wheels
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 9477
ENTRYPOINT ["syncwatch"]
CMD ["daemon", "--listen", "0.0.0.0:9477"]
