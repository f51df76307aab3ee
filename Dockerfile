# The PoC model server (model_server.py) and its Vast.ai PyWorker (worker.py) on a CUDA PyTorch runtime image.
#
#   docker build -t poc-server .
#   docker run --gpus all -p 18000:18000 -e POC_HOST=0.0.0.0 poc-server                  # PoC v1 only
#   docker run --gpus all -e POC_MODEL=/models/Qwen3-8B -v /models:/models poc-server    # + PoC v2 for that checkpoint
#
# The base image brings torch with CUDA; requirements.txt's CPU torch pin is filtered out, everything else is
# installed as pinned into /app/.venv (which sees the base image's torch), so start_server.sh's
# scripts/ensure_venv.sh finds it ready and installs nothing at start. The Vast PyWorker gets its own
# /app/.venv-worker from requirements-worker.txt (no torch); on a Vast serverless instance
# scripts/docker_entrypoint.sh also starts worker.py (see there). torch.compile's kernels are cached under
# /var/cache/poc (a volume: `-v poc-cache:/var/cache/poc` keeps them across a re-created container, so a restart
# does not compile again). Lint: hadolint Dockerfile (tests/test_worker.py).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    POC_HOST=127.0.0.1 \
    POC_PORT=18000 \
    MODEL_LOG=/var/log/model/server.log \
    POC_SPOOL_DIR=/var/lib/poc/spool \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/poc/torchinductor \
    TRITON_CACHE_DIR=/var/cache/poc/triton

# curl for the HEALTHCHECK (and for a person in the container); the distribution's current version
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt requirements-worker.txt requirements-test.txt pyproject.toml ./
RUN python -m venv --system-site-packages .venv \
    && grep -v '^torch==' requirements.txt > /tmp/requirements-image.txt \
    && .venv/bin/pip install --no-cache-dir -r /tmp/requirements-image.txt \
    && .venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
RUN python -m venv .venv-worker \
    && .venv-worker/bin/pip install --no-cache-dir -r requirements-worker.txt

COPY . .
RUN .venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation -e . \
    && touch ".venv/.installed-$(cat requirements.txt requirements.txt requirements-worker.txt requirements-test.txt \
        pyproject.toml | sha256sum | cut -c1-16)" \
    && touch ".venv-worker/.installed-$(cat requirements-worker.txt requirements.txt requirements-worker.txt \
        requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)" \
    && mkdir -p /var/log/model /var/lib/poc/spool /var/cache/poc
VOLUME ["/var/cache/poc"]

# 18000: the model server; 3000: the PyWorker (WORKER_PORT on Vast)
EXPOSE 18000 3000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["/bin/sh", "-c", "curl -fsS \"http://127.0.0.1:${POC_PORT}/health\" > /dev/null || exit 1"]
CMD ["scripts/docker_entrypoint.sh"]
