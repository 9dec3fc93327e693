# kdtree images. Targets:
#   server   SGLang 0.5.23 + kdtree + the verify kernel, entered through the validating launcher (default target)
#   sidecar  rollout control (FastAPI, Docker SDK); no torch, no SGLang
#   kernel   the CUDA toolkit from PyPI and the built library (a build stage; tagged by CI to inspect it)
#
#   docker build -t kdtree-server .
#   docker build --target sidecar -t kdtree-sidecar .
#
# Builds with the legacy builder and with BuildKit: no RUN --mount, no heredocs. The legacy builder builds
# every stage above the target, so the stages are ordered cheapest first.
#
# Build arguments:
#   BASE_IMAGE          a Debian bookworm image with python3 (>= 3.11), venv and ca-certificates
#   KDTREE_CUDA_ARCHS   CMake CUDA architectures compiled into the kernel library ("90;100;120")
# Extra CA certificates (TLS-intercepting proxies): put PEM files named *.crt into build/ca-certificates/
# before building; they are added to the system bundle that pip (PIP_CERT) and Python use.

ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
# Every image and intermediate layer of this file carries the label (CI prunes only those).
LABEL org.opencontainers.image.title="kdtree"
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# .dockerignore is always in the context, so the COPY succeeds when the certificate folder is absent.
COPY .dockerignore build/ca-certificate[s] /tmp/extra-ca/
RUN set -eu; \
    for cert in /tmp/extra-ca/*.crt; do [ -e "$cert" ] && cp "$cert" /usr/local/share/ca-certificates/; done; \
    update-ca-certificates >/dev/null; \
    rm -rf /tmp/extra-ca; \
    python3 -m venv /opt/venv; \
    useradd --system --uid 10001 --user-group --create-home --home-dir /home/kdtree kdtree; \
    mkdir -p /var/run/kdtree; chown kdtree:kdtree /var/run/kdtree
WORKDIR /opt/kdtree/src

# ---------------------------------------------------------------------------------------------------
FROM base AS requirements
# Dependency lists from pyproject.toml. The install steps copy these files, not pyproject.toml, so
# editing anything else in pyproject.toml (or any code) reinstalls nothing.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
[open(f'/opt/kdtree/requirements-{extra}.txt', 'w').write('\n'.join(p['dependencies'] + deps) + '\n') \
 for extra, deps in p['optional-dependencies'].items()]"

# ---------------------------------------------------------------------------------------------------
FROM base AS sidecar
COPY --from=requirements /opt/kdtree/requirements-sidecar.txt /tmp/
RUN pip install -r /tmp/requirements-sidecar.txt
COPY pyproject.toml README.m[d] ./
COPY kdtree kdtree
COPY sidecar sidecar
COPY entrypoint entrypoint
RUN pip install --no-deps . && rm -rf build *.egg-info
USER kdtree
WORKDIR /home/kdtree
EXPOSE 8080
CMD ["python", "-m", "sidecar"]

# ---------------------------------------------------------------------------------------------------
FROM base AS kernel
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make \
 && rm -rf /var/lib/apt/lists/*
# The CUDA 13.0 toolkit as SGLang 0.5.23's torch uses it, from PyPI, into a fixed prefix
# (nvcc.profile searches lib64; the wheels install lib).
RUN pip install --target /opt/cuda \
      'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*' \
      'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*' \
 && ln -s lib /opt/cuda/nvidia/cu13/lib64 \
 && pip install --no-deps --target /opt/cuda-tools 'nvidia-cuda-cuobjdump>=13.2,<14' \
 && ln -s /opt/cuda-tools/nvidia/cu13/bin/cuobjdump /usr/local/bin/cuobjdump \
 && pip install 'cmake>=3.28,<4'
ENV CUDA_HOME=/opt/cuda/nvidia/cu13 \
    PATH=/opt/cuda/nvidia/cu13/bin:$PATH
ARG KDTREE_CUDA_ARCHS="90;100;120"
COPY kernel_build /opt/kdtree/src/kernel_build
RUN cmake -S kernel_build -B /opt/kdtree/kernel -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="${KDTREE_CUDA_ARCHS}" \
      -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
 && cmake --build /opt/kdtree/kernel -j2 \
 && cuobjdump --list-elf /opt/kdtree/kernel/libkdtree_verify.so

# ---------------------------------------------------------------------------------------------------
FROM base AS server-deps
# sglang==0.5.23 and its CUDA 13 torch (~11 GB).
COPY --from=requirements /opt/kdtree/requirements-server.txt /tmp/
RUN pip install -r /tmp/requirements-server.txt
# cuobjdump lets the launcher list the library's GPU code (PyPI has it from 13.2; it reads 13.0 objects).
RUN pip install --no-deps --target /opt/cuda-tools 'nvidia-cuda-cuobjdump>=13.2,<14' \
 && ln -s /opt/cuda-tools/nvidia/cu13/bin/cuobjdump /usr/local/bin/cuobjdump \
 && cuobjdump --version
# Triton (SGLang's Triton attention backend, the benchmark's baseline) compiles its CUDA driver module and each
# kernel's launcher with the host C compiler at first use, against Python.h: without them no Triton kernel runs.
# (Python.h: python:*-slim images carry it; Debian's python3 needs python3-dev.) After the pip layers, which stay cached.
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev; \
    python -c "import os, sysconfig; os.stat(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null \
      || apt-get install -y --no-install-recommends python3-dev; \
    rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------------
FROM server-deps AS server
COPY pyproject.toml README.m[d] ./
COPY kdtree kdtree
COPY --from=kernel /opt/kdtree/kernel/libkdtree_verify.so kdtree/lib/
COPY sidecar sidecar
COPY entrypoint entrypoint
# sitecustomize alone on PYTHONPATH (the entrypoint package itself is installed into the venv).
RUN pip install --no-deps . && rm -rf build *.egg-info \
 && mkdir -p /opt/kdtree/site && cp entrypoint/sitecustomize.py /opt/kdtree/site/
ENV PYTHONPATH=/opt/kdtree/site \
    KDTREE_STATE_DIR=/var/run/kdtree \
    KDTREE_VERIFY=validate \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER kdtree
WORKDIR /home/kdtree
EXPOSE 30000
ENTRYPOINT ["python", "-m", "entrypoint.launch"]
