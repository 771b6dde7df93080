#!/usr/bin/env bash
# The GPU check for one short lease on a CUDA machine: a thin wrapper around benchmarks/gpu_check.py
# (its docstring and docs/bench.md, "The GPU check", say what it runs and under which limits).
# Usage, from the repository root: OUT=results_dir bash benchmarks/gpu_check.sh [gpu_check.py options]
# Runs without installing: PYTHONPATH=src. Wheels carried in .whl/ (schedulefree, simplejpeg: not on the
# machine's image) are installed into /tmp/site first and put on the path too.
set -u
export GPU_CHECK_START=${GPU_CHECK_START:-$(date +%s.%N)}  # the check's time limit counts from here
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "gpu_check.sh: installing the carried wheels failed; going on without them"
fi
SITE=""
[ -d /tmp/site ] && SITE=/tmp/site
export PYTHONPATH="$PWD/src${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; echo "cores: $(nproc)"; } | head -5
exec $PY benchmarks/gpu_check.py --out "$OUT" "$@"
