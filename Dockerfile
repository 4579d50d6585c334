# fusedserve's GPU image (the default) and CPU image, from this one file:
#   docker build -t fusedserve:gpu . && docker run --gpus all -p 8000:8000 -p 8001:8001 fusedserve:gpu
#   docker build --build-arg FLAVOUR=cpu --build-arg TORCH_INDEX=<PyTorch's CPU wheel index> -t fusedserve:cpu .
# The bases are build arguments too: `make container-test` builds the CPU image on a local Debian base.
# podman before 4.4 (buildah 1.28) ignores ARG defaults in FROM: pass FLAVOUR there even for gpu.
ARG FLAVOUR=gpu
# torch 2.11.0+cu130 with triton 3.6, the build every GPU figure was measured on. The devel flavour
# carries the C compiler that Triton needs at run time to build its launchers.
ARG GPU_BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${GPU_BASE} AS gpu-runtime
# The venv sees the base image's torch and triton, so the project installs beside them, not over them.
RUN python -m venv --system-site-packages /opt/venv

FROM ${CPU_BASE} AS cpu-runtime
# PyPI's Linux torch is a CUDA build of several GB; the +cpu build comes from PyTorch's CPU wheel
# index (TORCH_INDEX) or, as in `make container-test`, from a folder of wheels mounted at build time.
# A CPU build pins no triton: triton 3.6 comes with the project below.
ARG CPU_TORCH=torch==2.13.0+cpu
ARG TORCH_INDEX=""
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$CPU_TORCH"

FROM ${FLAVOUR}-runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FUSEDSERVE_HOST=0.0.0.0 \
    FUSEDSERVE_PORT=8000 \
    FUSEDSERVE_MODEL_REPOSITORY=/models \
    FUSEDSERVE_TUNE_CACHE=/home/fusedserve/.cache/fusedserve \
    TRITON_CACHE_DIR=/home/fusedserve/.cache/triton

WORKDIR /app
COPY pyproject.toml README.md ./
# Dependencies in a layer of their own, so a change to the sources reinstalls only the project.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY kernels ./kernels
COPY models ./models
COPY service ./service
COPY fusedserve ./fusedserve
COPY deploy/healthcheck.py ./
# The shipped model repository also lives at /models, so a volume mounted there replaces it. UID
# 10001, not 1000: Ubuntu-based images already give 1000 to a user of their own.
RUN pip install --no-cache-dir --no-deps . \
    && cp -r models/repository /models \
    && useradd --create-home --uid 10001 --user-group fusedserve \
    && chown -R fusedserve /models

USER 10001
# Triton's kernels for the shipped repository's batch buckets, compiled here for the sm_90 GPUs (H100,
# H200) without one (`fusedserve precompile`, docs/deploy.md) into TRITON_CACHE_DIR: a fresh container
# loads them at warm-up instead of compiling them. Buckets up to 256 rows also serve any smaller
# FUSEDSERVE_MAX_BATCH_SIZE that is a power of two. The CPU flavour carries them too, unused, so
# `make container-test` checks this step.
ARG PRECOMPILE_MAX_BATCH_SIZE=256
RUN fusedserve precompile --max-batch-size "$PRECOMPILE_MAX_BATCH_SIZE"
# HTTP, and KServe v2 gRPC (FUSEDSERVE_GRPC_PORT's default)
EXPOSE 8000 8001
# Ready once every model is loaded, tuned and warm: on an H200 with an empty tune cache the shipped
# repository took 112 s, one more 4x2048 model 192 s. healthcheck.py asks the configured host and port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 CMD ["python", "/app/healthcheck.py"]
CMD ["fusedserve", "serve"]
