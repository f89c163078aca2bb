# The API with its in-process worker, on the CPU (NumPy/OpenBLAS).
#   docker build -t nnetc .
#   docker run -p 8000:8000 -e NNETC_REDIS_URL=redis://redis:6379/0 nnetc
# Settings are NNETC_* environment variables (service/settings.py, README "Service").
# deploy/docker-compose.yml runs it beside Redis; deploy/gpu.Dockerfile is the CuPy image.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY service ./service
COPY schemas ./schemas
COPY bench ./bench
# gcc only while installing: it builds the optimizer's C passes
# (engine/optimizer/_native.c) and the product kernel (engine/core/_sgemm.c), then goes
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install . \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && (cd / && python -c "import engine.optimizer._native, engine.core._sgemm") \
    && useradd --system --uid 10001 --no-create-home nnetc

USER nnetc
# listen on every interface inside the container.  OpenBLAS starts a thread per core it
# may run on, which a CPU quota (docker run --cpus N) does not reduce: set
# OPENBLAS_NUM_THREADS=N with it (the service logs a warning at start otherwise)
ENV NNETC_HOST=0.0.0.0 \
    NNETC_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2).status == 200 else 1)"]
CMD ["nnetc", "serve"]
