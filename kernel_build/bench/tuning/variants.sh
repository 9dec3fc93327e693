#!/usr/bin/env bash
# Kernel variants side by side in one GPU-machine call: tuning work, each variant timed against the others
# in the same run (the committed table still comes from `device_run.sh bench` on a commit).
#
# here: bash kernel_build/bench/tuning/variants.sh add NAME REF [NVCC_FLAG...]
#   copies kernel_build (CMakeLists.txt, src, include) at git REF (`.`: the working tree) to .variants/NAME
#   with extra nvcc flags, e.g. `add q8 HEAD -DKDTREE_WIDE_QREG=8`. .variants is git-ignored: carry it to the
#   GPU machine along with .whl.
# GPU:  bash kernel_build/bench/tuning/variants.sh run [ROUNDS] [fp8]
#   builds every variant for the local GPU, runs the kernel GPU tests against each (a variant that fails or
#   hangs is dropped after one timeout instead of hanging every benchmark after it), then the quick benchmark
#   of the others ROUNDS times (default 2), in reverse order every other round. Log: $OUT/variants.log.
#   KDTREE_VARIANTS_GRID replaces the quick grid with bench_verify.py's own arguments (`--ddtree`, `--shape ...`).
#   With fp8: the fp8 kernel tests (tests/gpu/test_fp8_gpu.py) instead, and bench_pools.py's times (bf16 and both
#   fp8 dtypes, both configurations) in $OUT/pools.jsonl, with their table at the end of the log.
set -uo pipefail
cd "$(dirname "$0")/../../.."
dir=$(realpath -m "${KDTREE_VARIANTS_DIR:-.variants}")  # relative to the repository root
usage="usage: $0 add NAME REF [NVCC_FLAG...] | $0 run [ROUNDS] [fp8]"

case "${1:-}" in
add)
  [ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
  name=$2 ref=$3; shift 3
  [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "variant name '$name': use letters, digits, '.', '_' or '-'" >&2; exit 2; }
  if [ "$ref" != . ] && ! git rev-parse -q --verify "$ref^{commit}" >/dev/null; then
    echo "no commit '$ref': name a branch, tag or commit, or '.' for the working tree" >&2; exit 2
  fi
  rm -rf "${dir:?}/$name" && mkdir -p "$dir/$name"
  if [ "$ref" = . ]; then
    cp -r kernel_build/CMakeLists.txt kernel_build/src kernel_build/include "$dir/$name/"
    origin="working tree of $(git rev-parse --short HEAD)"
  else
    git archive "$ref" kernel_build/CMakeLists.txt kernel_build/src kernel_build/include \
      | tar -x -C "$dir/$name" --strip-components=1
    origin=$(git rev-parse --short "$ref")
  fi
  echo "$*" >"$dir/$name/flags"
  echo "$origin $*" >"$dir/$name/origin"
  echo "$dir/$name: $origin $*"
  ;;
run)
  rounds=${2:-2} pools=${3:-}
  grid=${KDTREE_VARIANTS_GRID:---quick}  # bench_verify.py's shapes for the timed rounds, e.g. "--shape 1,8,65,32768 --shape ..."
  [ -z "$pools" ] || [ "$pools" = fp8 ] || { echo "$usage" >&2; exit 2; }
  tests=tests/gpu/test_kernel_gpu.py
  [ -z "$pools" ] || tests=tests/gpu/test_fp8_gpu.py
  names=()
  for f in "$dir"/*/flags; do [ -e "$f" ] && names+=("$(basename "$(dirname "$f")")"); done
  [ ${#names[@]} -gt 0 ] || { echo "no variants in $dir: add them with '$0 add' and carry them here" >&2; exit 2; }
  t0=$SECONDS
  source kernel_build/bench/gpu_env.sh
  if [ ${#names[@]} -gt 7 ]; then  # the device tool returns at most 8 files from $OUT
    echo "warning: ${#names[@]} variants: the logs of some will not come back from \$OUT (at most 8 files)" >&2
  fi
  log=$out/variants.log  # each variant's build and test output beside it: $out/NAME.log
  : >"$log"
  say() { echo "$*" | tee -a "$log"; }
  for n in "${names[@]}"; do  # all builds at once: a few seconds each
    (cmake -S "$dir/$n" -B "$dir/$n/build" -DCMAKE_CUDA_ARCHITECTURES="${cc}-real" -DCMAKE_CUDA_FLAGS="$(cat "$dir/$n/flags")" \
      && cmake --build "$dir/$n/build" -j4) >"$out/$n.log" 2>&1 &
  done
  wait
  say "builds: $((SECONDS - t0)) s"
  ok=()
  for n in "${names[@]}"; do
    lib=$dir/$n/build/libkdtree_verify.so
    if [ ! -f "$lib" ]; then
      say "## $n ($(cat "$dir/$n/origin")): build failed, dropped (see $out/$n.log)"
      continue
    fi
    KDTREE_KERNEL_LIB=$lib timeout 180 python3 -m pytest -p no:cacheprovider -q -x "$tests" \
      -W ignore::DeprecationWarning >>"$out/$n.log" 2>&1
    rc=$?
    summary=$(tail -1 "$out/$n.log")
    say "## $n ($(cat "$dir/$n/origin")): kernel tests rc=$rc: $summary ($((SECONDS - t0)) s)"
    if [ $rc = 0 ] && [[ $summary != *skipped* ]]; then
      ok+=("$n")
    else  # rc 124: timed out (a hang); skipped tests: the variant was not checked
      say "   dropped, see $out/$n.log"
    fi
  done
  [ ${#ok[@]} -gt 0 ] || { say "no variant passed its tests: nothing to time"; exit 1; }
  # The roofline's mma.sync rate, measured once by the first variant's library (the same code in every variant).
  mma=$(KDTREE_KERNEL_LIB=$dir/${ok[0]}/build/libkdtree_verify.so python3 kernel_build/bench/tuning/mma_peak.py) &&
    [ -n "$mma" ] || { echo "mma_peak.py failed: no usable GPU" >&2; exit 1; }
  say "mma.sync bf16: $mma TFLOP/s"
  for ((r = 0; r < rounds; r++)); do
    order=("${ok[@]}")
    if ((r % 2)); then mapfile -t order < <(printf '%s\n' "${ok[@]}" | tac); fi
    for n in "${order[@]}"; do
      say "## round $r: $n ($((SECONDS - t0)) s)"
      if [ -n "$pools" ]; then
        KDTREE_KERNEL_LIB=$dir/$n/build/libkdtree_verify.so timeout 120 \
          python3 kernel_build/bench/tuning/bench_pools.py time "$n" "$out/pools.jsonl" 2>&1 | tail -3 | tee -a "$log"
        continue
      fi
      KDTREE_KERNEL_LIB=$dir/$n/build/libkdtree_verify.so timeout 240 \
        python3 kernel_build/bench/benchmarks/bench_verify.py --mma-tflops "$mma" $grid --ours-only 2>&1 | grep '^b[0-9]' | tee -a "$log"
    done
  done
  [ -z "$pools" ] || python3 kernel_build/bench/tuning/bench_pools.py table "$out/pools.jsonl" | tee -a "$log"
  say "variants: $((SECONDS - t0)) s"
  ;;
*)
  echo "$usage" >&2; exit 2
  ;;
esac
