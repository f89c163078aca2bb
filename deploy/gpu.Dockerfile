# The API with its in-process worker on an NVIDIA GPU (CuPy, CUDA 12).
#   docker build -f deploy/gpu.Dockerfile -t nnetc-gpu .
#   docker run --gpus 1 -p 8000:8000 nnetc-gpu
# NNETC_BACKEND=cupy runs every computation on the GPU (weights kept on the device,
# decoding forwards replayed as CUDA graphs: engine/runtime/cuda_graph.py).
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY service ./service
COPY schemas ./schemas
COPY bench ./bench
# (gcc builds the optimizer's C passes, engine/optimizer/_native.c, and the product kernel,
# engine/core/_sgemm.c)
RUN pip install ".[gpu]" \
    && (cd / && python -c "import engine.optimizer._native, engine.core._sgemm") \
    && useradd --system --uid 10001 --no-create-home nnetc

USER nnetc
ENV NNETC_HOST=0.0.0.0 \
    NNETC_PORT=8000 \
    NNETC_BACKEND=cupy
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2).status == 200 else 1)"]
CMD ["nnetc", "serve"]
