#!/usr/bin/env bash
# The GPU checks, as one script for a short lease on a CUDA machine: the `gpu`-marked tests, then the
# throughput bench (naive, each technique, all) on CUDA, then time to accuracy on digits.
# Usage: OUT=results_dir bash benchmarks/gpu_check.sh [test_seconds] [bench_seconds] [tta_seconds]
# Runs from the repository root without installing: PYTHONPATH=src (plus /tmp/site when the
# optional extras were unpacked there). Each part has its own time limit and its own log, so one
# part that fails or runs long leaves the others' results.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T_TEST=${1:-200} T_BENCH=${2:-120} T_TTA=${3:-120}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; git rev-parse HEAD 2>/dev/null
  $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== gpu tests"
timeout "$T_TEST" $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 150 \
  tests/train/test_train_gpu.py tests/train/test_precision.py tests/tune/test_batch.py \
  tests/data/test_decode.py tests/data/test_augment.py tests/bench/test_bench_gpu.py \
  tests/doctor/test_gpu.py tests/distributed/test_launch.py > "$OUT/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests.txt"
tail -30 "$OUT/gpu_tests.txt"

echo "== bench (throughput, resnet18 at 32 px, CUDA)"
timeout "$T_BENCH" $PY -m torchspeed bench --device cuda --model resnet18 --no-tta \
  --json "$OUT/bench_cuda_resnet18.json" > "$OUT/bench_cuda_resnet18.txt" 2>&1
echo "rc=$?" >> "$OUT/bench_cuda_resnet18.txt"
tail -30 "$OUT/bench_cuda_resnet18.txt"

echo "== time to accuracy (digits, resnet20, CUDA)"
timeout "$T_TTA" $PY -m torchspeed bench --device cuda --data digits --model resnet20 --quick --no-hand \
  --seeds 2 --tta-configs naive,all,auto --json "$OUT/bench_cuda_digits.json" > "$OUT/bench_cuda_digits.txt" 2>&1
echo "rc=$?" >> "$OUT/bench_cuda_digits.txt"
tail -40 "$OUT/bench_cuda_digits.txt"
