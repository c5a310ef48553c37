#!/usr/bin/env bash
# Every GPU check of the "GPU truth" work in one device command, and its preflight here:
#
#     bash scripts/gpu_truth.sh --preflight    # here, no GPU needed: fetch and check what travels,
#                                              # then print the device call
#     bash scripts/gpu_truth.sh [OUT_DIR]      # there, through that call (carry: [".whl"])
#
# The device run installs the wheels carried in .whl/ (scripts/gpu_wheels.txt: megatron-core for
# the host's Python 3.12, pytest-timeout), then runs the GPU tests (each under pytest-timeout's
# limit; test_bench_gpu's are CPU checks of what the bench-gpu step runs whole), optimus-profile on
# the single-GPU and Figure 5 configs, the scheduler benchmark with that profile against the
# roofline, benchmarks/bench_gpu.py, and one training step per mode under torch.profiler. Each step
# runs under `timeout` with the limit written beside it; the limits, with the install, fit one
# device command (COMMAND_LIMIT_S), which the preflight checks. Everything printed goes to
# OUT_DIR/gpu_truth.log, the profiles, JSON and the profiled steps' timelines beside it
# (OUT_DIR defaults to $OUT, where the device returns files, else ./gpu_truth_out).
# Each step runs even if one before it failed; the exit code is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
COMMAND_LIMIT_S=600  # one device command
INSTALL_LIMIT_S=45   # pip installing .whl/
KILL_AFTER_S=5       # a step still running this long after its limit is killed
TEST_LIMIT_S=100     # one GPU test

ENVIRONMENT='nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c '\
'"import sys, torch, megatron.core as m; '\
'print(sys.version.split()[0], torch.__version__, torch.version.cuda, m.__version__)"'

steps() {  # every step of the device run: step NAME LIMIT_S COMMAND...
  step environment 30 sh -c "$ENVIRONMENT"
  step gpu-tests 110 python3 -m pytest -q -p no:warnings -rs --timeout "$TEST_LIMIT_S" \
    tests/distributed/test_streams.py tests/unit/test_profiler.py
  step profile-gpu-single 25 python3 -m optimus_mllm.cli.profile --config configs/gpu_single.yaml \
    --out "$out/profile_gpu_single.json"
  step profile-fig5 25 python3 -m optimus_mllm.cli.profile --config configs/paper/fig5_8gpu.yaml \
    --out "$out/profile_fig5.json"
  step bench-scheduler 20 python3 benchmarks/bench_scheduler.py --only fig5_8gpu --one-reading \
    --profile "$out/profile_fig5.json" --json "$out/bench_scheduler.json"
  step bench-gpu 140 python3 benchmarks/bench_gpu.py --json "$out/bench_gpu.json"
  # one profiled training step per mode, its timeline beside it: where Optimus's step time goes
  # beside the baseline's
  for mode in baseline optimus; do
    step "profile-train-$mode" 65 python3 benchmarks/bench_gpu.py --train-mode "$mode" --steps 1 \
      --warmup 2 --json "/tmp/train_$mode.json" --profile-rows 25 \
      --trace "$out/train_$mode.trace.json.gz"
  done
}

if [ "${1:-}" = --preflight ]; then
  out=OUT  # a placeholder: the preflight reads which files the steps leave there
  table=$(mktemp)
  trap 'rm -f "$table"' EXIT
  step() {  # record the step: name, limit, arguments joined by \x1f
    local IFS=$'\x1f'
    printf '%s\t%s\t%s\n' "$1" "$2" "${*:3}" >> "$table"
  }
  steps
  python3 scripts/gpu_preflight.py --steps "$table" --out-dir "$out" \
    --command-limit "$COMMAND_LIMIT_S" --install-limit "$INSTALL_LIMIT_S" \
    --kill-after "$KILL_AFTER_S"
  exit $?
fi

out=${1:-${OUT:-gpu_truth_out}}
mkdir -p "$out"
log="$out/gpu_truth.log"
: > "$log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  timeout -k "$KILL_AFTER_S" "$INSTALL_LIMIT_S" python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_truth.sh: installing .whl/*.whl failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

status=0
step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, log it, keep the first failure
  echo "=== $1 (limit $2 s): ${*:3}" | tee -a "$log"
  local started=$SECONDS
  timeout -k "$KILL_AFTER_S" "$2" "${@:3}" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 124 ] || echo "=== $1: stopped at its $2 s limit" | tee -a "$log"
  echo "=== $1: exit $rc after $((SECONDS - started)) s" | tee -a "$log"
  [ "$status" -ne 0 ] || status=$rc
}
steps
exit "$status"
