# The Headroom API: planner + store over HTTP on port 8000 (docker-compose.yml adds PostgreSQL).
#
#   docker build -t headroom-api .
#   docker run --rm -p 8000:8000 -e HEADROOM_TOKEN=... headroom-api      # SQLite in /app/data
#
# Settings are HEADROOM_* environment variables (api/settings.py). The image installs the
# package with its service extra (headroom-planner[service]); torch is not needed by the API and is not
# installed. One worker by default; HEADROOM_WORKERS=N runs N (the database is
# migrated once before they start; uvloop is installed, see docs/PERFORMANCE.md).

# ---- build: install the package and its dependencies into a virtual environment
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# .dockerignore lets in only pyproject.toml, README.md and the package folders
COPY . .
RUN pip install ".[service]" && pip check

# ---- runtime: the virtual environment, a non-root user, nothing else
FROM python:3.11-slim

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HEADROOM_DATABASE_URL=sqlite:////app/data/headroom.db \
    HEADROOM_RUN_DIR=/app/runs

RUN groupadd --system --gid 10001 headroom \
    && useradd --system --uid 10001 --gid headroom --home-dir /app --no-create-home \
       --shell /usr/sbin/nologin headroom \
    && mkdir -p /app/data /app/runs \
    && chown -R headroom:headroom /app

COPY --from=build /opt/venv /opt/venv

WORKDIR /app
USER headroom:headroom
EXPOSE 8000
VOLUME ["/app/data"]

# slim has no curl: ask /healthz with the interpreter already in the image
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

# `headroom serve` migrates the database once, then starts the workers (HEADROOM_WORKERS)
CMD ["sh", "-c", "exec headroom serve --host 0.0.0.0 --port 8000 --workers ${HEADROOM_WORKERS:-1}"]
