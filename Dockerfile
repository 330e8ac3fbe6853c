# CPU image of every Banyan service (tokenizer, scheduler, worker): the embedded demo model, or a
# mounted --model, on the CPU. The GPU image is Dockerfile.gpu (same layout, CUDA base).
#
#   docker build -t banyan:cpu .                                      # needs BuildKit (RUN --mount)
#   docker build --build-arg BASE_IMAGE=banyan-base:bookworm ...      # what scripts/docker_ci.sh does
#
# Layers go from the slowest-changing to the fastest: OS packages → torch (from docker/wheels/ when
# a CPU wheel lies there, else the PyTorch CPU index) → the third-party dependencies, keyed on the
# dependency list alone (not on the rest of pyproject.toml) → Banyan's code. Editing code rebuilds
# only the last small layers. No `# syntax=` line: it would make BuildKit pull a frontend image; the
# daemon's built-in frontend reads this file.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE} AS python

# Python 3.11 from Debian in a venv (Debian's own Python is PEP 668 "externally managed").
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DEFAULT_TIMEOUT=120

# The dependency list (+ the otel extra, so BANYAN_OTLP_ENDPOINT works, and the gateway extra: the
# Shepherd Model Gateway's `smg` binary, for compose's `gateway` profile) out of pyproject.toml: the
# layer below that installs it is rebuilt only when this file's content changes.
FROM python AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
e = p['optional-dependencies']; print('\n'.join(p['dependencies'] + e['otel'] + e['gateway']))" > /requirements.txt

FROM python
LABEL org.opencontainers.image.title="banyan" org.opencontainers.image.vendor="banyan" \
      org.opencontainers.image.description="Banyan LLM serving engine: tokenizer, scheduler and worker (CPU)"

# torch, CPU build. The optional `ca` secret is a CA bundle for pip behind a TLS-inspecting proxy;
# it is mounted for these steps only and never stored in a layer.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    set -e; wheel=$(ls /wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n1); \
    if [ -n "$wheel" ]; then pip install "$wheel"; \
    else pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"; fi

# Third-party dependencies. xgrammar pulls in triton (1 GB) for its GPU kernels only; its CPU path
# (what the worker uses here) runs without it.
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    set -e; pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" "setuptools>=68" \
 && pip uninstall -y triton \
 && rm /tmp/requirements.txt

# Banyan itself (no dependency resolution: they are all above), then the demo model, built once
# here so that no container builds it at start-up.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY banyan banyan
COPY services services
COPY deploy/healthcheck.py /usr/local/bin/banyan-healthcheck
RUN chmod 755 /usr/local/bin/banyan-healthcheck \
 && pip install --no-deps --no-build-isolation . \
 && BANYAN_CACHE_DIR=/opt/banyan-cache python3 -c "from banyan.demo import ensure_demo_model; print(ensure_demo_model())" \
 && chmod -R a+rX /opt/banyan-cache \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin banyan

ENV BANYAN_CACHE_DIR=/opt/banyan-cache
USER banyan
EXPOSE 50051 8000 5557 5558 9100 30000
CMD ["banyan", "--help"]
