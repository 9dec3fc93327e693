#!/usr/bin/env bash
# Download, on a machine with network, the Python 3.12 wheels that let SGLang 0.5.23's Python side
# (its Triton attention kernels and TritonAttnBackend) import on an offline GPU machine
# whose image already has torch, triton, numpy, transformers and most common packages.
#
# usage: kernel_build/bench/fetch-wheels.sh DIR    (DIR is usually .whl in the repo root, git-ignored)
# Copy DIR to the GPU machine as .whl in the repo root: kernel_build/bench/device_run.sh installs it into
# /tmp/site. SGLang's compiled packages (sgl_kernel etc.) are not fetched: standins/sglang_stubs.py stands
# in for them; the attention path (extend_attention_fwd, TritonAttnBackend, MLATokenToKVPool) never calls them.
# About 56 MiB: with the checkout, under the 64 MiB one GPU-machine call may carry (jedi, 5 MiB, is left out:
# IPython runs without it).
set -euo pipefail
dir=${1:?usage: $0 DIR}
mkdir -p "$dir"
pkgs=(
  sglang==0.5.23 orjson pybase64 starlette msgspec pydantic==2.14.4 pydantic_core==2.50.5 pyzmq dill
  apache-tvm-ffi==0.1.11 compressed_tensors==0.18.0 loguru gguf openai==2.8.0 partial_json_parser
  annotated-types typing-inspection jiter distro sniffio
  IPython traitlets prompt_toolkit wcwidth decorator matplotlib-inline stack_data
  executing asttokens pure_eval pexpect ptyprocess ipython_pygments_lexers
  uvicorn fastapi annotated-doc h11 click opentelemetry-api importlib-metadata zipp
  pytest pluggy iniconfig pytest-timeout pydantic-settings python-dotenv  # the test runner and kdtree.config
  tenacity  # the sidecar, run against the real server by tests/gpu/test_engine_gpu.py
  # what sglang.launch_server's HTTP server imports (not SGLang's attention path): the real server's GPU tests
  jsonschema jsonschema-specifications referencing rpds-py soundfile cffi pycparser zstandard python-multipart
)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$p" 2>&1 | grep -E '^ERROR' || true
done
du -sh "$dir"
