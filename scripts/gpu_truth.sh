#!/usr/bin/env bash
# Every GPU check of the "GPU truth" work in one run, on a CUDA host such as the device machine:
#
#     bash scripts/fetch_gpu_wheels.sh        # here, with pip: megatron-core for the GPU host's Python 3.12
#     bash scripts/gpu_truth.sh [OUT_DIR]     # there: (run with `carry: [".whl"]` through the device tool)
#
# It installs the wheels carried in .whl/ (if any), then runs the GPU tests, optimus-profile on the
# single-GPU and Figure 5 configs, the scheduler benchmark with that profile against the roofline, and
# scripts/bench_gpu.py. Everything printed goes to OUT_DIR/gpu_truth.log, the profiles and benchmark
# JSON beside it (OUT_DIR defaults to $OUT, else ./gpu_truth_out). Each step runs even if one before
# it failed; the exit code is the first failure's.
set -uo pipefail
out=${1:-${OUT:-gpu_truth_out}}
mkdir -p "$out"
log="$out/gpu_truth.log"
: > "$log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_truth.sh: installing .whl/*.whl failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

status=0
step() {  # step NAME COMMAND...: run it, log its output, remember the first failure
  echo "=== $1: ${*:2}" | tee -a "$log"
  "${@:2}" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $1: exit $rc" | tee -a "$log"
  [ "$status" -ne 0 ] || status=$rc
}

step environment sh -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], torch.__version__, torch.version.cuda, m.__version__)"'
step gpu-tests python3 -m pytest -q -p no:warnings -rs tests/test_streams.py tests/test_profiler.py tests/test_bench_gpu.py
step profile-gpu-single python3 -m optimus_mllm.cli.profile --config configs/gpu_single.yaml --out "$out/profile_gpu_single.json"
step profile-fig5 python3 -m optimus_mllm.cli.profile --config configs/paper/fig5_8gpu.yaml --out "$out/profile_fig5.json"
step bench-scheduler python3 scripts/bench_scheduler.py --only fig5_8gpu --one-reading \
  --profile "$out/profile_fig5.json" --json "$out/bench_scheduler.json"
step bench-gpu python3 scripts/bench_gpu.py --json "$out/bench_gpu.json"
exit "$status"
