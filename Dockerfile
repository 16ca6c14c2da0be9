# syntax=docker/dockerfile:1
# The server's images, one recipe with three targets (docs/deployment.md shows how each is run):
#
#   docker build -t qwen3-tts-server:gpu .                  # the default: CUDA torch, for NVIDIA GPUs
#   docker build --target cpu -t qwen3-tts-server:cpu .     # the CPU build of torch, no CUDA at all
#   docker build --target ray -t qwen3-tts-server:ray .     # the GPU image plus Ray Serve (deploy/kuberay)
#
# Python packages are installed by scripts/install.sh only, the script tests/test_install.py runs in a fresh
# environment on every CI run; nothing else here installs a Python package (a test checks that too). The build
# context is the package sources and that script (.dockerignore). Each image runs as the unprivileged user `tts`
# (uid 1000, named by number so Kubernetes' runAsNonRoot can verify it), keeps voices in /data/voice_profiles and
# reads a checkpoint from /models: mount volumes there.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- the environments: /opt/venv, built by scripts/install.sh ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY . .

# No GPU is visible while an image builds, so each stage names its torch build (TORCH_VARIANT).
FROM source AS venv-cpu
RUN TORCH_VARIANT=cpu scripts/install.sh /opt/venv

FROM source AS venv-gpu
RUN TORCH_VARIANT=cuda scripts/install.sh /opt/venv

FROM source AS venv-ray
# Ray in the image must be the version the cluster runs (rayVersion in deploy/kuberay/rayservice.yaml).
ARG RAY_VERSION=2.60.0
RUN TORCH_VARIANT=cuda scripts/install.sh --extras ray --pin "ray==${RAY_VERSION}" /opt/venv

# --- what every image shares: the user, the data directories, the settings -------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --uid 1000 --create-home --shell /bin/bash tts \
    && mkdir -p /data/voice_profiles /models \
    && chown -R tts:tts /data
# TTS_PROFILES_DIR: the voice profiles (a volume: voices outlive the container); in the working directory /data, so
# the extractor's default --output-dir (voice_profiles) is the same folder. TTS_DEMO_DIR: where the tiny demo
# checkpoint is written when TTS_MODEL_PATH is unset. Set TTS_MODEL_PATH=/models/<checkpoint> for a real model.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TTS_HOST=0.0.0.0 \
    TTS_PORT=8090 \
    TTS_PROFILES_DIR=/data/voice_profiles \
    TTS_DEMO_DIR=/data/demo-tiny
WORKDIR /data
VOLUME ["/data/voice_profiles"]
EXPOSE 8090
# SIGTERM drains: requests in flight finish (up to TTS_DRAIN_TIMEOUT, 30 s), then exit 0. Give the container
# longer than that to stop (docker stop -t 60, compose's stop_grace_period).
STOPSIGNAL SIGTERM

# --- the CPU server ----------------------------------------------------------------------------------------------
FROM runtime AS cpu
COPY --from=venv-cpu /opt/venv /opt/venv
USER 1000:1000
# /health: 200 while the process can serve (starting, serving or draining), 503 once the engine died beyond
# recovery. Readiness (engine loaded and warm, not draining) is GET /ready, for an orchestrator's readiness probe.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TTS_PORT', '8090'), timeout=4)"]
CMD ["qwen3-tts-server"]

# --- what the GPU images share: a C compiler for Triton, the GPUs visible -----------------------------------------
FROM runtime AS runtime-cuda
# gcc: Triton compiles its launcher for the fast path's kernels at run time (the CUDA libraries come with torch's
# wheels; the driver comes from the host through the NVIDIA container toolkit: docker run --gpus ...).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# --- Ray Serve: one replica per GPU (python -m tts_serve), or a KubeRay head/worker (deploy/kuberay) ------------
FROM runtime-cuda AS ray
# wget: KubeRay's health probes call it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
# KubeRay starts Ray through a login shell (bash -l), whose /etc/profile resets PATH: put the environment back.
# hadolint ignore=SC2016
RUN echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/qwen3-tts-venv.sh
COPY --from=venv-ray /opt/venv /opt/venv
USER 1000:1000
# The proxy answers /-/healthz itself; /health goes through it to a replica.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/-/healthz' % os.environ.get('TTS_PORT', '8090'), timeout=4)"]
CMD ["python", "-m", "tts_serve"]

# --- the GPU server (the default target) -------------------------------------------------------------------------
FROM runtime-cuda AS gpu
COPY --from=venv-gpu /opt/venv /opt/venv
USER 1000:1000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TTS_PORT', '8090'), timeout=4)"]
CMD ["qwen3-tts-server"]
