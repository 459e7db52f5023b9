# The broker as a container image:
#
#   scripts/debian-base                      # once: the pinned base, made from Debian's archive
#   DOCKER_BUILDKIT=1 docker build -t resumable-stream-broker .
#   docker run -p 8000:8000 -e BROKER_REDIS_URL=redis://redis:6379/0 resumable-stream-broker
#
# The base is Debian trixie with Debian's Python 3.13. ARG BASE names it: by default the image
# scripts/debian-base makes from Debian's archive as it was on one date (a dated snapshot), so
# a rebuild gets the same packages; `--build-arg BASE=debian:trixie-slim@sha256:<digest>`
# builds on Docker Hub's instead. The runtime dependencies are installed at exactly the
# versions of constraints.txt. CI (scripts/image-ci) builds this very file.
#
# Without BROKER_REDIS_URL the broker starts its embedded Valkey inside the container (a demo,
# not durable). compose.yaml runs it with a real Redis, two API replicas and a worker.
ARG BASE=broker-base:debian-trixie-20261201

FROM ${BASE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# Only what the package build needs (see .dockerignore); installed, not editable. The wheel is
# built first, then installed with its dependencies at the locked versions. A machine whose
# TLS is intercepted passes its CA bundle as a secret (`--secret id=ca,src=<bundle>`): used for
# the download, never stored in a layer.
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY broker ./broker
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/broker \
    && /opt/broker/bin/pip wheel --no-deps --wheel-dir /tmp/wheel . \
    && /opt/broker/bin/pip install --only-binary :all: -c constraints.txt /tmp/wheel/*.whl \
    && /opt/broker/bin/pip uninstall -y pip \
    && find /opt/broker -name __pycache__ -prune -exec rm -rf {} + \
    && /opt/broker/bin/python -m compileall -q /opt/broker/lib

FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/broker/bin:/usr/sbin:/usr/bin:/sbin:/bin
# Python alone: no compiler, no pip, no apt lists.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
    && useradd --system --uid 10001 --user-group --home-dir /home/broker --create-home broker
COPY --from=build /opt/broker /opt/broker

USER broker
WORKDIR /home/broker

# The address and port are settings, not flags, so that the health check reads the same port
# (`-e BROKER_PORT=8001` moves both, e.g. for several containers on the host's network).
ENV BROKER_HOST=0.0.0.0 \
    BROKER_PORT=8000
EXPOSE 8000
# No curl in the image: the probe is Python's own urllib (a non-2xx answer raises).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['BROKER_PORT'], timeout=2)"]

# The exec form: the broker is PID 1's only process and gets SIGTERM itself, so it drains.
ENTRYPOINT ["broker"]
CMD ["serve"]
