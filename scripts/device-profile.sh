#!/usr/bin/env bash
# The profile behind docs/benchmarks.md's row (b) and (d) notes: where an ask and a worker's
# start go, on the GPU machine.  Outputs land in $OUT (the device tool) or ./out.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 MESHD_MPS_LOG_LEVEL=warning
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -c 'import uvloop; print("uvloop", uvloop.__version__)'; } > "$OUT/env.txt" 2>&1
python3 -X importtime -c 'import meshd_mps.serving.cli, workers.main, workers.cuda_gpu' 2>&1 | sort -t'|' -k2 -n | tail -25 > "$OUT/importtime.txt"
for i in 1 2 3; do /usr/bin/time -f "bare-import %e s" python3 -c 'import cuda.bindings.driver'; /usr/bin/time -f "worker-import %e s" python3 -c 'import meshd_mps.serving.cli, workers.main, workers.cuda_gpu'; done >> "$OUT/importtime.txt" 2>&1
timeout 200 python3 scripts/ask_breakdown.py --gpu cuda -n 3000 > "$OUT/breakdown.txt" 2>&1
echo "rc=$?" >> "$OUT/breakdown.txt"
timeout 60 py-spy record --subprocesses --idle -r 2000 -f raw -o "$OUT/worker-ask.raw" -- python3 scripts/ask_breakdown.py --only worker --gpu cuda -n 20000 > "$OUT/pyspy.txt" 2>&1
echo "rc=$?" >> "$OUT/pyspy.txt"
timeout 300 python3 -m meshd_mps bench --only b,c,d --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "rc=$?" >> "$OUT/bench.txt"
