# Sourced on a GPU machine by device_run.sh and variants.sh: sets $out (logs: $OUT or ./device-out) and $cc
# (the GPU's compute capability, e.g. 90), installs SGLang's Python wheels from .whl when present, and exports
# the PYTHONPATH the GPU tests and the benchmarks import from
# (the real-server harness in kernel_build/bench/harness/, the stand-ins in standins/). (The mma.sync rate the roofline uses is measured by
# the kernel library: kernel_build/bench/tuning/mma_peak.py.)
out=${OUT:-$PWD/device-out}
mkdir -p "$out" kernel_build/build
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
[ -n "$cc" ] || { echo "no GPU found (nvidia-smi reported no compute capability)" >&2; exit 1; }
if [ -d .whl ]; then  # once per machine: several scripts of one call may source this, even at the same time
  if [ ! -f /tmp/site/.from-whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.from-whl
  fi
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/kernel_build/bench/harness:$PWD/standins:${PYTHONPATH:-} PYTHONUNBUFFERED=1
