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
#   KDTREE_REVISION     the commit built from: --build-arg KDTREE_REVISION="$(git rev-parse HEAD)" (OCI label
#                       org.opencontainers.image.revision; .ci/docker.sh sets it, and KDTREE_CREATED, the build time)
#   KDTREE_SOURCE       where that commit can be fetched (org.opencontainers.image.source)
# Python dependencies come pinned with hashes from requirements/*.lock (generated from pyproject.toml by
# requirements/lock.sh) and are installed with --require-hashes: a changed or unpinned package fails the build.
# Extra CA certificates (TLS-intercepting proxies): put PEM files named *.crt into build/ca-certificates/
# before building; they are added to the system bundle that pip (PIP_CERT) and Python use.

ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
# Every image and intermediate layer of this file carries the label (CI prunes only those).
LABEL org.opencontainers.image.title="kdtree" \
      org.opencontainers.image.licenses="Apache-2.0"
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
    groupadd --system --gid 10001 kdtree; \
    useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kdtree kdtree; \
    mkdir -p /var/run/kdtree; chown kdtree:kdtree /var/run/kdtree
WORKDIR /opt/kdtree/src

# ---------------------------------------------------------------------------------------------------
FROM base AS sidecar
# The lock alone decides what is installed (editing pyproject.toml or any code reinstalls nothing); it also
# holds the build backend, so the project installs without fetching anything.
COPY requirements/sidecar.lock /tmp/
RUN pip install --require-hashes --no-deps -r /tmp/sidecar.lock
COPY pyproject.toml README.m[d] ./
COPY kdtree kdtree
COPY sidecar sidecar
COPY kdtreectl kdtreectl
COPY entrypoint entrypoint
# Its own user, not the server's: whatever runs in the server (model code under --trust-remote-code) cannot read
# the sidecar's files. Both write the state volume (group-writable, setgid) through their group 10001.
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info \
 && useradd --system --uid 10002 --gid 10001 --create-home --home-dir /home/kdtree-sidecar kdtree-sidecar \
 && chmod 2775 /var/run/kdtree
USER kdtree-sidecar
WORKDIR /home/kdtree-sidecar
EXPOSE 8080
CMD ["python", "-m", "sidecar"]
# Provenance last: a new commit or build time changes only this layer.
ARG KDTREE_VERSION=0.1.0
ARG KDTREE_REVISION=unknown
ARG KDTREE_SOURCE=unknown
ARG KDTREE_CREATED=unknown
LABEL org.opencontainers.image.version="${KDTREE_VERSION}" \
      org.opencontainers.image.revision="${KDTREE_REVISION}" \
      org.opencontainers.image.source="${KDTREE_SOURCE}" \
      org.opencontainers.image.created="${KDTREE_CREATED}" \
      org.opencontainers.image.description="kdtree sidecar: health-gated verify-mode rollout for the kdtree server"

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
# sglang==0.5.23 and its CUDA 13 torch (~11 GB), as the lock pins them.
COPY requirements/server.lock /tmp/
RUN pip install --require-hashes --no-deps -r /tmp/server.lock
# cuobjdump lets the launcher list the library's GPU code (PyPI has it from 13.2; it reads 13.0 objects).
RUN pip install --no-deps --target /opt/cuda-tools 'nvidia-cuda-cuobjdump>=13.2,<14' \
 && ln -s /opt/cuda-tools/nvidia/cu13/bin/cuobjdump /usr/local/bin/cuobjdump \
 && cuobjdump --version
# Compilers the server runs at first use, after the pip layers (which stay cached):
# - Triton (SGLang's Triton attention backend, the benchmark's baseline) builds its CUDA driver module and each
#   kernel's launcher with the host C compiler against Python.h (python:*-slim images carry it; Debian's python3
#   needs python3-dev);
# - SGLang's JIT kernels (e.g. the MLA KV-cache store on sm_90+) and FlashInfer's build with nvcc and the host
#   C++ compiler; nvcc and the CUDA 13 headers come with the wheels above, laid out as a toolkit at
#   /usr/local/cuda (CUDA_HOME): lib64 and the libcudart.so link name are what a toolkit has and the wheels lack.
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc g++ libc6-dev; \
    python -c "import os, sysconfig; os.stat(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null \
      || apt-get install -y --no-install-recommends python3-dev; \
    rm -rf /var/lib/apt/lists/*; \
    cuda=$(python -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))"); \
    "$cuda/bin/nvcc" --version >/dev/null; \
    ln -s lib "$cuda/lib64"; ln -s libcudart.so.13 "$cuda/lib/libcudart.so"; ln -s "$cuda" /usr/local/cuda
ENV CUDA_HOME=/usr/local/cuda

# ---------------------------------------------------------------------------------------------------
FROM server-deps AS server
COPY pyproject.toml README.m[d] ./
COPY kdtree kdtree
COPY --from=kernel /opt/kdtree/kernel/libkdtree_verify.so kdtree/lib/
COPY sidecar sidecar
COPY kdtreectl kdtreectl
COPY entrypoint entrypoint
# sitecustomize alone on PYTHONPATH (the entrypoint package itself is installed into the venv).
# The state volume's mount point, group-writable and setgid (every file in it is group 10001's): the sidecar
# (uid 10002, group 10001) writes it too. A new named volume copies this ownership and mode.
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info \
 && mkdir -p /opt/kdtree/site && cp entrypoint/sitecustomize.py /opt/kdtree/site/ \
 && chmod 2775 /var/run/kdtree
# One cache root for everything the server compiles or caches at run time, created here and owned by the
# runtime user: a new named volume mounted on it (compose's kdtree-cache) copies that ownership, where a
# mount point missing from the image would be created root-owned and unwritable for uid 10001.
ENV XDG_CACHE_HOME=/home/kdtree/.cache
ENV TRITON_CACHE_DIR=${XDG_CACHE_HOME}/triton \
    SGLANG_CACHE_DIR=${XDG_CACHE_HOME}/sglang \
    SGLANG_JIT_CACHE_DIR=${XDG_CACHE_HOME}/sglang/jit \
    FLASHINFER_WORKSPACE_BASE=/home/kdtree \
    TORCHINDUCTOR_CACHE_DIR=${XDG_CACHE_HOME}/torchinductor \
    CUDA_CACHE_PATH=${XDG_CACHE_HOME}/nv \
    HF_HOME=${XDG_CACHE_HOME}/huggingface \
    HF_MODULES_CACHE=${XDG_CACHE_HOME}/huggingface/modules
# (SGLang keeps its DeepGEMM, TileLang and CuTe caches under SGLANG_CACHE_DIR; FlashInfer appends .cache/flashinfer
# to FLASHINFER_WORKSPACE_BASE; HF_MODULES_CACHE is where --trust-remote-code copies a model's code.)
RUN set -eu; \
    for d in "$TRITON_CACHE_DIR" "$SGLANG_JIT_CACHE_DIR" "$XDG_CACHE_HOME/flashinfer" "$TORCHINDUCTOR_CACHE_DIR" \
             "$CUDA_CACHE_PATH" "$HF_MODULES_CACHE"; do mkdir -p "$d"; done; \
    chown -R kdtree:kdtree "$XDG_CACHE_HOME"
# An old driver: the NVIDIA runtime refuses the container with its own message naming the CUDA version.
ENV PYTHONPATH=/opt/kdtree/site \
    KDTREE_STATE_DIR=/var/run/kdtree \
    KDTREE_VERIFY=validate \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0"
USER kdtree
WORKDIR /home/kdtree
EXPOSE 30000
ENTRYPOINT ["python", "-m", "entrypoint.launch"]
# Provenance last: a new commit or build time changes only this layer.
ARG KDTREE_VERSION=0.1.0
ARG KDTREE_REVISION=unknown
ARG KDTREE_SOURCE=unknown
ARG KDTREE_CREATED=unknown
LABEL org.opencontainers.image.version="${KDTREE_VERSION}" \
      org.opencontainers.image.revision="${KDTREE_REVISION}" \
      org.opencontainers.image.source="${KDTREE_SOURCE}" \
      org.opencontainers.image.created="${KDTREE_CREATED}" \
      org.opencontainers.image.description="kdtree server: SGLang 0.5.23 with tree-verify attention for MLA models"
