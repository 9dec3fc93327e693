#!/usr/bin/env bash
# Docker side of CI: a running engine, a locally built base image, and the kdtree images.
#
#   .ci/docker.sh tools    install docker.io, docker-compose (v1), debootstrap, and the curl and openssl the
#                          README's demo runs (tests/stack/test_image.py), from Debian when missing
#   .ci/docker.sh engine   start dockerd when no engine answers
#   .ci/docker.sh base     build the bookworm base image once (debootstrap + docker import); reused when present.
#                          Alone it installs only debootstrap (when missing) and uses the engine that answers.
#                          Root only where it installs or builds (a root shell as it is; another user: sudo)
#   .ci/docker.sh build    build the kernel, server and sidecar targets on that base
#   .ci/docker.sh all      all of the above, in order (default)
#
# No registry is reachable from CI, so the base is made from Debian packages; the public default
# (python:3.12-slim-bookworm) is what users get without --build-arg BASE_IMAGE.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${KDTREE_BASE_IMAGE:-kdtree-test-base:bookworm}
IMAGE_TAG=${KDTREE_IMAGE_TAG:-ci}
CA_BUNDLE=${KDTREE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
CUDA_ARCHS=${KDTREE_CUDA_ARCHS:-90;100;120}
LOG_DIR=${KDTREE_CI_LOG_DIR:-build/ci-logs}

log() { printf '[docker.sh] %s\n' "$*" >&2; }

need_root() {  # apt-get installs and debootstrap makes a root file system: both need root
  [ "$(id -u)" -eq 0 ] && return
  log "$1 needs root: run it in a root shell as it is, or as this user: sudo bash .ci/docker.sh ${COMMAND}"
  exit 1
}

tools() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v curl >/dev/null || missing+=(curl)
  command -v openssl >/dev/null || missing+=(openssl)
  if [ ${#missing[@]} -gt 0 ]; then
    need_root "installing ${missing[*]}"
    log "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

debootstrap_tool() {
  command -v debootstrap >/dev/null && return
  need_root "installing debootstrap"
  log "installing debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}

need_engine() {  # a user's host: its own engine, never a second dockerd beside it
  local err
  err=$(docker info 2>&1 >/dev/null) && return
  case "$err" in
    *"permission denied"*) log "this user may not use the Docker engine's socket: sudo bash .ci/docker.sh ${COMMAND}" ;;
    *) log "no Docker engine answers: start yours (e.g. systemctl start docker), or '.ci/docker.sh engine' starts dockerd" ;;
  esac
  exit 1
}

engine() {
  if docker info >/dev/null 2>&1; then return; fi
  log "starting dockerd (log: /tmp/dockerd.log)"
  # Its own session, so it outlives the shell that started it, and none of that shell's descriptors past
  # stdio: a caller's lock (`flock LOCK .ci/docker.sh ...`) would otherwise stay held for dockerd's life.
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    exec setsid nohup dockerd >/tmp/dockerd.log 2>&1 </dev/null
  ) &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  log "dockerd did not answer within 60 s; see /tmp/dockerd.log"; exit 1
}

base() {
  # Reuse a present base only when it has what the Dockerfile needs (venv, pip, the CA bundle).
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 &&
    docker run --rm "$BASE_IMAGE" sh -c 'python3 -m venv --help && python3 -m pip --version &&
      test -s /etc/ssl/certs/ca-certificates.crt && command -v update-ca-certificates useradd' >/dev/null 2>&1; then
    log "base $BASE_IMAGE present"; return
  fi
  debootstrap_tool
  need_root "debootstrap"
  local root
  root=$(mktemp -d /tmp/kdtree-base.XXXXXX)
  log "debootstrap bookworm into $root"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
    bookworm "$root" http://deb.debian.org/debian >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$root" "$root.log"
  log "base $BASE_IMAGE built"
}

build() {
  # The host's CA bundle goes into the build context's extra-CA folder: containers reach PyPI only
  # through certificates the host trusts (see Dockerfile, "Extra CA certificates").
  mkdir -p build/ca-certificates "$LOG_DIR"
  if [ -f "$CA_BUNDLE" ]; then cp "$CA_BUNDLE" build/ca-certificates/host-bundle.crt; fi
  # Provenance labels (Dockerfile, last layer of each image): the commit, where it came from, the build time.
  local revision source created
  revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  source=$(git config --get remote.origin.url 2>/dev/null | grep -E '^(https://|git@)' || echo unknown)
  created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local target start
  for target in kernel sidecar server; do
    start=$(date +%s)
    log "building kdtree-$target:$IMAGE_TAG (log: $LOG_DIR/build-$target.log)"
    # --force-rm: the legacy builder (no BuildKit) otherwise leaves a failed step's container behind, stopped.
    if ! docker build --force-rm --target "$target" -t "kdtree-$target:$IMAGE_TAG" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg KDTREE_CUDA_ARCHS="$CUDA_ARCHS" \
        --build-arg KDTREE_REVISION="$revision" --build-arg KDTREE_SOURCE="$source" \
        --build-arg KDTREE_CREATED="$created" \
        . >"$LOG_DIR/build-$target.log" 2>&1; then
      tail -40 "$LOG_DIR/build-$target.log" >&2; exit 1
    fi
    log "kdtree-$target:$IMAGE_TAG built in $(( $(date +%s) - start )) s," \
      "$(docker image inspect -f '{{.Size}}' "kdtree-$target:$IMAGE_TAG" | numfmt --to=iec)"
  done
  # Untagged leftovers of replaced kdtree builds only (the Dockerfile labels every layer).
  docker image prune -f --filter label=org.opencontainers.image.title=kdtree >/dev/null
}

COMMAND=${1:-all}
case "$COMMAND" in
  tools) tools ;;
  engine) tools; engine ;;
  base) need_engine; base ;;
  build) tools; engine; build ;;
  all) tools; engine; base; build ;;
  *) echo "usage: $0 [tools|engine|base|build|all]" >&2; exit 2 ;;
esac
