# fusedserve on a CUDA GPU: docker build -t fusedserve . && docker run --gpus all -p 8000:8000 fusedserve
# The devel flavour carries the C compiler that Triton needs at run time to build its launchers;
# torch 2.11 in it pins triton 3.6, the version our kernels are written for.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FUSEDSERVE_HOST=0.0.0.0 \
    FUSEDSERVE_PORT=8000 \
    FUSEDSERVE_MODEL_REPOSITORY=/models \
    FUSEDSERVE_TUNE_CACHE=/home/fusedserve/.cache/fusedserve \
    TRITON_CACHE_DIR=/home/fusedserve/.cache/triton

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY models ./models
COPY service ./service
COPY fusedserve ./fusedserve
# The shipped model repository also lives at /models, so a volume mounted there replaces it.
RUN python -m pip install --no-cache-dir . \
    && cp -r models/repository /models \
    && useradd --create-home --uid 1000 --user-group fusedserve \
    && chown -R fusedserve /models

USER 1000
EXPOSE 8000
# Ready only once every model is loaded, tuned and warm (start-up autotuning takes a while).
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)"]
CMD ["fusedserve", "serve", "--host", "0.0.0.0"]
