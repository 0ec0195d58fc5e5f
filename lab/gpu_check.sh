#!/usr/bin/env bash
# The CUDA checklist in one run on a GPU machine (docs/gpu.md): the Triton kernels natively, the
# engine on CUDA against HF transformers on the same GPU, the kernel benchmark, one 70B-TP8 shard
# layer against tokenbus plan's roofline, and bench-engine against HF generate. Each step has its
# own time limit and log under $OUT (default /tmp/gpu-check); a short summary comes last.
# Python packages the machine lacks may come as wheels in .whl/ (installed under /tmp/site).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENBUS_HOME=${TOKENBUS_HOME:-/tmp/tokenbus-home}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
fi
PYTEST="python3 -m pytest -p no:cacheprovider -q -rfE --durations=8"

step() {   # step NAME LIMIT_S COMMAND...: the command's output in $OUT/NAME.log, its status in the summary
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - start)) s" >>"$OUT/summary.txt"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__,
triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
} >"$OUT/env.log" 2>&1

# correctness first, both at once (no timing in them)
step kernels 150 $PYTEST tests/kernels/test_triton.py tests/kernels/test_triton_ops.py \
    tests/kernels/test_triton_engine.py &
step engine 180 $PYTEST -s tests/workers/test_cuda.py tests/workers/test_sampler.py -k "cuda or Cuda"
wait
# then the measurements, one at a time
step kernel-bench 120 python3 -m lab.benchmarks.kernels
step shard 120 python3 -m lab.benchmarks.kernels --shard
step bench-engine 100 python3 -m ops.cli bench-engine --model small --num-requests 64 --input-len 128 512 \
    --output-len 128 128 --repeat 2

cat "$OUT/env.log" "$OUT/summary.txt"
for log in kernels engine; do
    echo "== $log"
    grep -E "passed|failed|error|FAILED|ERROR|bf16 argmax" "$OUT/$log.log" | tail -25
done
for log in kernel-bench shard bench-engine; do
    echo "== $log"
    tail -45 "$OUT/$log.log"
done
