#!/usr/bin/env bash
# The images' pip installs, pinned with hashes, from pyproject.toml: requirements/sidecar.lock and
# requirements/server.lock (the base dependencies, the image's extra, and the build backend that installs the
# project itself). The Dockerfile installs them with --require-hashes. Run after changing a dependency:
#
#   pip install uv && bash requirements/lock.sh
#
# One universal resolution for Python 3.11 and newer (the CI base's python3.11 and the default
# python:3.12-slim-bookworm); tests/stack/test_locks.py checks that each lock still agrees with pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
build_backend=$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
for extra in sidecar server; do
  printf '%s\n' "$build_backend" | uv pip compile --quiet pyproject.toml - --extra "$extra" \
    --universal --python-version 3.11 --generate-hashes \
    --custom-compile-command "bash requirements/lock.sh" -o "requirements/$extra.lock"
done
