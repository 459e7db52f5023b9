# The broker as a container image: `docker build -t resumable-stream-broker .`
#
#   docker run -p 8000:8000 -e BROKER_REDIS_URL=redis://redis:6379/0 resumable-stream-broker
#
# Without BROKER_REDIS_URL the broker starts its embedded Valkey inside the container (a demo,
# not durable). compose.yaml runs it with a real Redis, two API replicas and a worker.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package build needs (see .dockerignore); installed, not editable.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY broker ./broker
RUN pip install . && rm -rf build *.egg-info

RUN useradd --system --uid 10001 --user-group --home-dir /home/broker --create-home broker
USER broker
WORKDIR /home/broker

EXPOSE 8000
# No curl in the slim image: the probe is Python's own urllib (a non-2xx answer raises).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]

ENTRYPOINT ["broker"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
