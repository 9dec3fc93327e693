#!/usr/bin/env bash
# On a GPU machine: build for the local GPU, install SGLang's Python wheels (from .whl, if present),
# run the GPU tests, then the benchmark. Logs and the table go to $OUT (or ./device-out).
# usage: bash kernel_build/bench/device_run.sh [tests|bench|ddtree-grid|modes|profile|engine-tests|engine|engine-spec|oracle|traffic|engine-profile|fp8|userbench|all] [args...]
# 'tests' runs the GPU suite (all but the real-server tests) in the device's tile configuration, then (below
# sm_120, where that is wide) again with KDTREE_KERNEL_CONFIG=compact.
# 'engine-tests' runs the real SGLang server's GPU tests (tests/gpu/test_engine_gpu.py), 'engine' the end-to-end
# benchmark (bench_engine.py: engine.md + engine.json; its args after the mode); both first install kdtree with the
# library just built into the wheels' site folder (/tmp/site), as the server image installs it. 'engine-profile'
# records a few decode steps of the real server with SGLang's profiler (profile_engine.py: where a step's GPU time
# goes, off against on; engine-profile.md + .json).
# 'engine-spec' (one call of under 560 s on an H200, build included: KDTREE_SPEC_TESTS_S and KDTREE_SPEC_BUDGET_S
# end the tests and the whole) runs the real-server tests of SGLang's DFLASH worker and kdtree's DDTREE
# (test_engine_gpu.py -k "dflash or ddtree": off / validate / on / standby, DDTREE's oracle; 'engine-tests' leaves
# them out), then, in what is left of the call, the end-to-end benchmark's DFLASH and DDTREE rows (block 16 first:
# DDTREE's tree of 32 beside DFlash's chain of 16; engine-spec.md + .json: 8 layers,
# prompts 2048 and 32768, batch 1, 2 rounds; args after the mode go to the tests). The tail of each server's log goes
# to $OUT/spec-logs.
#        bash kernel_build/bench/device_run.sh userbench [kdtree.bench args...]
# 'oracle' (one call of under 560 s, build included: KDTREE_ORACLE_BUDGET_S ends it) runs the oracle benchmark
# (bench_oracle.py: DFlash's chain against DDTREE's fixed budgets at two scripted acceptance profiles, 61 layers;
# oracle.md + .json, rewritten after every row; args after the mode go to it, e.g. --prompts 2048), the tail of each
# server's log into $OUT/oracle-logs.
# 'traffic' (one call of under 560 s, build included: KDTREE_TRAFFIC_BUDGET_S ends it) runs the real server under the
# seeded serving mix (bench_traffic.py: every configuration held to its invariants, exit 1 on a broken one;
# traffic.md + .json; args after the mode go to it, e.g. --configs none,ddtree-on --sequential), the tail of each
# server's log into $OUT/traffic-logs.
# 'userbench' runs what users run in the server image, python -m kdtree.bench (default --quick), into
# $OUT/userbench (bench.md + bench.json); 'all' leaves it out.
# 'ddtree-grid' (one call of under 8 minutes on an H200, build included: KDTREE_DDTREE_BUDGET_S, default 470, ends the
# whole) times DDTree's grid (bench_verify.py --ddtree --no-torch: N 9 to 257, bs 1 and 4, 8 and 16 heads, prefixes 8k
# and 32k; the device's configuration and, below sm_120, compact beside it and SGLang's Triton kernel, with each one's
# share of the mma.sync rate measured in the same run): ddtree.md + ddtree.json, rewritten after every row, so a run
# cut off keeps its rows; args after the mode go to bench_verify.py. Then the GPU tests at DDTree's sizes
# (test_kernel_gpu.py and test_fp8_gpu.py -k "ddtree or short_prefix": ddtree-tests.xml + .log, the fp8 cases' errors
# in ddtree-fp8-errors.jsonl) and, if what is left of the budget holds another grid's time, what users run,
# python -m kdtree.bench --ddtree, into $OUT/userbench-ddtree.
# 'modes' measures what live mode switching costs per verify call (bench_modes.py: modes.md + modes.json).
# 'fp8' (one call of under 540 s on an H200, build included) runs the fp8 GPU tests (tests/gpu/test_fp8_gpu.py, both
# fp8 paths, and the fp8 pool tests of test_hook_gpu.py) in the device's configuration, with compact forced and with
# the mma path (its junit stays behind: fp8.log has its lines), the fp8 benchmark (bench_verify.py --fp8 --ours-only:
# both paths' fp8 columns beside bf16 on every row of the grid; fp8-bench.md + .json), then
# the rest of the GPU suite in both configurations (what 'tests' runs), each stage cut off (SIGINT: its junit
# report is still written) before the call's limit. $OUT gets at most 8 files: fp8-tests{,-compact}.xml,
# fp8-errors.jsonl (each exactness case's relative L2 errors), fp8-bench.{md,json}, suite{,-compact}.xml, and
# fp8.log.
# 'profile' (and 'all') profiles one batch-1 launch with Nsight Compute when ncu is present: ncu.txt (the
# summary sections) and ncu-source.csv (stall reasons per SASS instruction, from source-level sampling).
set -uo pipefail
what=${1:-all}; shift || true
parts="tests bench ddtree-grid modes profile engine-tests engine engine-spec oracle traffic engine-profile fp8 userbench all"
if [[ " $parts " != *" $what "* || "$what" == *[[:space:]]* ]]; then  # before the GPU probe: a typo or --help
  sed -n '2,4p' "$0"
  case "$what" in -h | --help) exit 0 ;; esac
  echo "device_run.sh: no part named '$what' (the parts: $parts)" >&2; exit 2
fi
t0=$SECONDS
source kernel_build/bench/gpu_env.sh
logs=$out
[ "$what" = fp8 ] && logs=$(mktemp -d)  # fp8 keeps $OUT to its eight files
cmake -S kernel_build -B kernel_build/build -DCMAKE_CUDA_ARCHITECTURES="${cc}-real" >"$logs/cmake.log" 2>&1 \
  && cmake --build kernel_build/build -j16 >"$logs/build.log" 2>&1 || { tail -30 "$logs/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
rc=0
install_site() {  # kdtree as a package (entry point included) with the library, beside SGLang's wheels
  mkdir -p kdtree/lib && cp kernel_build/build/libkdtree_verify.so kdtree/lib/
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --upgrade --target /tmp/site . \
    >"$out/install-site.log" 2>&1 || { tail -20 "$out/install-site.log"; exit 1; }
  export KDTREE_ENGINE_SITE=/tmp/site
  echo "kdtree installed into /tmp/site: $((SECONDS - t0)) s"
}
if [ "$what" = engine-tests ] || [ "$what" = all ]; then
  install_site
  python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_engine_gpu.py -k "not dflash and not ddtree" "$@" 2>&1 \
    | tee "$out/engine-tests.log"
  rc=${PIPESTATUS[0]}
  echo "engine tests: $((SECONDS - t0)) s (rc=$rc)"
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  install_site
  python3 kernel_build/bench/benchmarks/bench_engine.py --out "$out/engine.md" "$@" 2>&1 | tee "$out/engine.log"
  rc=${PIPESTATUS[0]}
  echo "engine benchmark: $((SECONDS - t0)) s (rc=$rc)"
fi
if [ "$what" = engine-spec ]; then
  install_site
  timeout -s INT -k 10 $((${KDTREE_SPEC_TESTS_S:-360} - (SECONDS - t0))) python3 -m pytest -p no:cacheprovider -q -rs \
    --basetemp=/tmp/engine-spec tests/gpu/test_engine_gpu.py -k "dflash or ddtree" "$@" 2>&1 | tee "$out/engine-spec-tests.log"
  rc=${PIPESTATUS[0]}
  echo "engine-spec tests: $((SECONDS - t0)) s (rc=$rc)"
  left=$((${KDTREE_SPEC_BUDGET_S:-560} - (SECONDS - t0)))
  if [ "$left" -gt 90 ] && grep -q " passed" "$out/engine-spec-tests.log"; then  # no benchmark of servers that cannot start
    timeout -s INT -k 10 "$left" python3 kernel_build/bench/benchmarks/bench_engine.py --out "$out/engine-spec.md" \
      --root /tmp/engine-spec-bench --algorithms DFLASH-B16,DDTREE-B16,DFLASH-B8,DDTREE-B8 --layers 8 --prompts 2048,32768 --batches 1 \
      --repeats 2 --max-tokens 64 --time-budget-s $((left - 60)) 2>&1 | tee "$out/engine-spec-bench.log"
    echo "engine-spec benchmark: $((SECONDS - t0)) s (rc=${PIPESTATUS[0]})"
  fi
  mkdir -p "$out/spec-logs"
  for f in /tmp/engine-spec/*/*/state/server.log /tmp/engine-spec-bench/*/state/server.log; do
    [ -f "$f" ] && tail -150 "$f" >"$out/spec-logs/$(basename "$(dirname "$(dirname "$f")")").log"
  done
fi
if [ "$what" = oracle ]; then
  install_site
  budget=${KDTREE_ORACLE_BUDGET_S:-560}
  timeout -s INT -k 10 $((budget - (SECONDS - t0))) python3 kernel_build/bench/benchmarks/bench_oracle.py \
    --out "$out/oracle.md" --time-budget-s $((budget - (SECONDS - t0) - 90)) "$@" 2>&1 | tee "$out/oracle.log"
  rc=${PIPESTATUS[0]}
  echo "oracle benchmark: $((SECONDS - t0)) s (rc=$rc)"
  mkdir -p "$out/oracle-logs"
  for f in /tmp/kdtree-bench-oracle/*/state/server.log; do
    [ -f "$f" ] && tail -150 "$f" >"$out/oracle-logs/$(basename "$(dirname "$(dirname "$f")")").log"
  done
fi
if [ "$what" = traffic ]; then
  install_site
  budget=${KDTREE_TRAFFIC_BUDGET_S:-560}
  timeout -s INT -k 10 $((budget - (SECONDS - t0))) python3 kernel_build/bench/benchmarks/bench_traffic.py \
    --out "$out/traffic.md" --time-budget-s $((budget - (SECONDS - t0) - 150)) "$@" 2>&1 | tee "$out/traffic.log"
  rc=${PIPESTATUS[0]}
  echo "traffic: $((SECONDS - t0)) s (rc=$rc)"
  mkdir -p "$out/traffic-logs"
  for d in /tmp/kdtree-bench-traffic/*/; do
    f="$d/state/server.log"; [ -f "$f" ] || f="$d/console.log"  # NONE runs without the launcher: its console
    [ -f "$f" ] && tail -150 "$f" >"$out/traffic-logs/$(basename "$d").log"
  done
fi
if [ "$what" = engine-profile ]; then
  install_site
  python3 kernel_build/bench/benchmarks/profile_engine.py --out "$out/engine-profile.md" "$@" 2>&1 | tee "$out/engine-profile.log"
  rc=${PIPESTATUS[0]}
  echo "engine profile: $((SECONDS - t0)) s (rc=$rc)"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -p no:cacheprovider -q -rs -m "not engine" tests/gpu "$@" 2>&1 | tee "$out/gpu-tests.log"; rc=${PIPESTATUS[0]}
  echo "tests: $((SECONDS - t0)) s (rc=$rc)"
  if [ "$cc" -lt 120 ]; then  # here auto is wide: the whole suite again in sm_120's configuration
    KDTREE_KERNEL_CONFIG=compact python3 -m pytest -p no:cacheprovider -q -rs -m "not engine" tests/gpu "$@" 2>&1 \
      | tee "$out/gpu-tests-compact.log"; rc_c=${PIPESTATUS[0]}
    [ "$rc" = 0 ] && rc=$rc_c
    echo "tests, compact forced: $((SECONDS - t0)) s (rc=$rc_c)"
  fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # The mma.sync rate the roofline uses is measured in the same run, by the library just built.
  python3 kernel_build/bench/benchmarks/bench_verify.py --out "$out/bench.md" 2>&1 | tee "$out/bench.log"
  echo "bench: $((SECONDS - t0)) s"
fi
if [ "$what" = ddtree-grid ]; then
  budget=${KDTREE_DDTREE_BUDGET_S:-470}
  left() { local l=$((budget - (SECONDS - t0))); echo $((l > 1 ? l : 1)); }  # to the budget's end
  t1=$SECONDS
  timeout -s INT -k 10 "$(left)" python3 kernel_build/bench/benchmarks/bench_verify.py --ddtree --no-torch \
    --out "$out/ddtree.md" "$@" 2>&1 | tee "$out/ddtree.log"
  rc=${PIPESTATUS[0]}
  grid_s=$((SECONDS - t1))
  echo "ddtree grid: $((SECONDS - t0)) s (rc=$rc)"
  # exactness at DDTree's sizes: bf16 and fp8 pools, both configurations, graphs captured short and replayed long
  KDTREE_FP8_ERRORS=$out/ddtree-fp8-errors.jsonl timeout -s INT -k 10 "$(left)" python3 -m pytest -p no:cacheprovider \
    -q -rs --junitxml="$out/ddtree-tests.xml" tests/gpu/test_kernel_gpu.py tests/gpu/test_fp8_gpu.py \
    -k "ddtree or short_prefix" 2>&1 | tee "$out/ddtree-tests.log"
  r=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$r
  echo "ddtree tests: $((SECONDS - t0)) s (rc=$r)"
  if [ "$(left)" -gt $((grid_s + 30)) ]; then  # another grid's time left: the users' command on the same grid
    timeout -s INT -k 10 "$(left)" python3 -m kdtree.bench --ddtree --out "$out/userbench-ddtree" 2>&1 \
      | tee "$out/userbench-ddtree.log"
    echo "userbench --ddtree: $((SECONDS - t0)) s (rc=${PIPESTATUS[0]})"
  fi
fi
if [ "$what" = userbench ]; then
  python3 -m kdtree.bench "$@" --out "$out/userbench" 2>&1 | tee "$out/userbench.log"; rc=${PIPESTATUS[0]}
  echo "userbench: $((SECONDS - t0)) s (rc=$rc)"
fi
if [ "$what" = modes ] || [ "$what" = all ]; then
  python3 kernel_build/bench/benchmarks/bench_modes.py --out "$out/modes.md" 2>&1 | tee "$out/modes.log"
  echo "modes: $((SECONDS - t0)) s"
fi
if [ "$what" = fp8 ]; then
  left() { local l=$((${KDTREE_FP8_BUDGET_S:-525} - (SECONDS - t0))); echo $((l > 1 ? l : 1)); }  # to the limit
  stage() {  # stage NAME JUNIT PYTEST_ARGS...: pytest cut off by SIGINT before the limit, its junit still written
    local name=$1 xml=$2; shift 2
    timeout -s INT -k 10 "$(left)" python3 -m pytest -p no:cacheprovider -q -rs --junitxml="$xml" "$@"
    local r=$?; echo "$name: $((SECONDS - t0)) s (rc=$r)"; [ "$rc" = 0 ] && rc=$r
  }
  export KDTREE_FP8_ERRORS=$out/fp8-errors.jsonl
  fp8_tests=(tests/gpu/test_fp8_gpu.py tests/gpu/test_hook_gpu.py -k "fp8")
  {
    stage "fp8 tests" "$out/fp8-tests.xml" "${fp8_tests[@]}" "$@"
    if [ "$cc" -lt 120 ]; then  # test_fp8_gpu forces both configurations and paths itself; the hook tests run in auto
      KDTREE_KERNEL_CONFIG=compact stage "fp8 tests, compact forced" "$out/fp8-tests-compact.xml" \
        tests/gpu/test_hook_gpu.py -k fp8 "$@"
    fi
    KDTREE_FP8_PATH=mma stage "fp8 hook tests, mma path" "$logs/fp8-tests-mma.xml" tests/gpu/test_hook_gpu.py -k fp8 "$@"
    timeout -s INT -k 10 "$(left)" python3 kernel_build/bench/benchmarks/bench_verify.py --fp8 --ours-only --calls 20 \
      --out "$out/fp8-bench.md"
    echo "fp8 bench: $((SECONDS - t0)) s (rc=$?)"
    stage "suite" "$out/suite.xml" -m "not engine" tests/gpu -k "not fp8" "$@"
    [ "$cc" -lt 120 ] && KDTREE_KERNEL_CONFIG=compact stage "suite, compact forced" "$out/suite-compact.xml" \
      -m "not engine" tests/gpu -k "not fp8" "$@"
  } 2>&1 | tee "$out/fp8.log"
  grep -q "(rc=[1-9]" "$out/fp8.log" && rc=1
fi
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if { [ "$what" = profile ] || [ "$what" = all ]; } && [ -n "$ncu_bin" ]; then
  timeout 240 "$ncu_bin" --clock-control none -k regex:tree_verify_kernel -c 1 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section SourceCounters --import-source no \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' -f -o /tmp/kdtree-ncu \
    python3 kernel_build/bench/benchmarks/bench_verify.py --mma-tflops 1 --quick --ours-only >"$out/ncu.log" 2>&1
  "$ncu_bin" -i /tmp/kdtree-ncu.ncu-rep --page details >"$out/ncu.txt" 2>&1
  "$ncu_bin" -i /tmp/kdtree-ncu.ncu-rep --page source --csv --print-source sass >"$out/ncu-source.csv" 2>&1
  echo "profile: $((SECONDS - t0)) s"
fi
exit $rc
