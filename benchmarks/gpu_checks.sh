#!/usr/bin/env bash
# The GPU checks of a session lent a GPU, as one command, each under its own time limit (0 skips it) so that the
# whole run fits one call: the kernel's launch-setting sweep, the GPU decode benchmark (with the sweep's best
# settings where the sweep ran), the Triton kernel tests, then tests/models/test_cuda.py. Logs, JSON, Markdown and the plot go to $OUT (the device tool's folder) or
# benchmarks/results/gpu.
#
#   bash benchmarks/gpu_checks.sh
#   SWEEP_S=0 KERNEL_S=100 BENCH_S=300 CUDA_S=120 CELLS=1b:16x16384,1b:1x4096 CUDA_K=kivi-2bit bash benchmarks/gpu_checks.sh
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
limit() {  # limit SECONDS COMMAND...: COMMAND for at most SECONDS; 0 skips it
  if [ "$1" -gt 0 ]; then timeout "$@"; else echo "skipped: $2 $3"; fi
}
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv
  $python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

limit "${SWEEP_S:-120}" $python benchmarks/kernel_sweep.py --out "$out/kernel_sweep.json" > /tmp/kernel_sweep.log 2>&1
echo "kernel sweep: exit $?"; tail -n 4 /tmp/kernel_sweep.log

limit "${BENCH_S:-300}" $python benchmarks/gpu_decode.py --out "$out" --kernel-settings "$out/kernel_sweep.json" \
  --cells "${CELLS:-1b:16x16384,1b:1x4096,8b:8x32768,1b:1x32768}" \
  --rows "${ROWS:-static-compiled,compiled:kivi-2bit,dynamic,kivi-2bit,compiled:kivi-4bit,compiled:frontier-2bit,compiled:tuned}" \
  --deadline-seconds "$(( ${BENCH_S:-300} - 45 ))" 2>&1 | grep -v "DEBUG" > "$out/gpu_decode.log"
echo "benchmark: exit ${PIPESTATUS[0]}"; grep -A40 "^## " "$out"/gpu_decode_*.md | head -n 60

limit "${KERNEL_S:-100}" $python -m pytest -q -p no:cacheprovider -p no:logging tests/ops/test_triton_decode.py \
  tests/ops/test_triton_higgs_encode.py > "$out/kernel_tests.log" 2>&1
echo "kernel tests: exit $?"; tail -n 3 "$out/kernel_tests.log"

limit "${CUDA_S:-120}" $python -m pytest -q -s -p no:cacheprovider -p no:logging tests/models/test_cuda.py \
  -k "${CUDA_K:-kivi-2bit or frontier-2bit}" > "$out/cuda_tests.log" 2>&1
echo "cuda tests: exit $?"; grep -E "max \||passed|failed|Error" "$out/cuda_tests.log" | tail -n 12
