#!/usr/bin/env bash
# One batched run on the GPU machine: the GPU test suite, `serve` end to end through the
# CLI in both modes, and the benchmark.  Outputs land in $OUT (the device tool) or ./out.
# Narrower runs: TESTS="tests/gpu/test_x.py ..." (default tests/gpu; skip: none), SERVE=0 (skip the CLI run),
# BENCH="--only i" (the bench's arguments; BENCH=skip: no bench), RING=1 (scripts/ring_variants.py
# first, into ring-variants.txt: the ring's device side against a bare kernel, issue 18),
# DAEMON_CPUS=N (serve --daemon-cpus N in the CLI run), PROBES="hold ask-cpu" (scripts/ring_probes.py's,
# after the bench, each into probe-K-NAME.txt, K its place in the list; NAME.LOOP, e.g. ask-cpu.uvloop, runs it on
# that event loop, by default asyncio).  GPU=sim: the same run on a CPU machine, on the simulated
# GPU and the stand-in MPS daemon (RING left out: it needs CUDA), to check a run before device time
# is spent on it.
set -u
TESTS=${TESTS:-tests/gpu}; SERVE=${SERVE:-1}; BENCH=${BENCH:-}; RING=${RING:-0}; DAEMON_CPUS=${DAEMON_CPUS:-}
PROBES=${PROBES:-}; GPU=${GPU:-cuda}
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if [ "$GPU" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then  # the GPU machine has no registry
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
if [ "$GPU" = sim ]; then RING=0; export PATH=$PWD/meshd_mps/standin:$PATH; fi
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; which nvidia-cuda-mps-control; } > "$OUT/env.txt" 2>&1
if [ "$RING" = 1 ]; then timeout 60 python3 scripts/ring_variants.py -n 10000 > "$OUT/ring-variants.txt" 2>&1; fi
if [ "$TESTS" != skip ]; then
  timeout 420 python3 -m pytest $TESTS -v -rA -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/gpu-tests.txt"
fi
for iso in $([ "$SERVE" = 1 ] && echo mps blink); do
  SD=$(mktemp -d /tmp/msv.XXXXXX); S=$SD/$iso.sock; L="$OUT/serve-$iso.txt"  # a private dir: the daemon refuses a shared one
  python3 -m meshd_mps serve --isolation $iso --socket $S --gpu $GPU --log-format console ${DAEMON_CPUS:+--daemon-cpus $DAEMON_CPUS} 2>/tmp/serve-$iso-log.txt &
  P=$!
  for i in $(seq 100); do python3 -m meshd_mps status --socket $S >/dev/null 2>&1 && break; sleep 0.2; done
  { set -x
    python3 -m meshd_mps load examples/heartbeat --socket $S
    python3 -m meshd_mps load examples/echo --socket $S
    python3 -m meshd_mps ps --socket $S
    for p in $P $(cat /proc/$P/task/*/children); do grep -H Cpus_allowed_list /proc/$p/status; done
    python3 -m meshd_mps call echo hello-gpu --socket $S
    python3 -m meshd_mps upgrade echo examples/echo --socket $S
    python3 -m meshd_mps call echo again --socket $S
    python3 -m meshd_mps ps --socket $S
    python3 -m meshd_mps status --socket $S
    python3 -m meshd_mps unload echo --socket $S
    python3 -m meshd_mps unload heartbeat --socket $S
    kill -TERM $P; wait $P; echo "serve rc=$?"
    ls -la $S; pgrep -af "nvidia-cuda-mps|meshd_mps worker" || echo "nothing left"
    set +x; } > "$L" 2>&1
  { echo "== the daemon's log"; tail -n 40 /tmp/serve-$iso-log.txt; } >> "$L"
done
if [ "$BENCH" != skip ]; then
  timeout 480 python3 -m meshd_mps bench --gpu $GPU $BENCH --json "$OUT/bench.json" > "$OUT/bench.txt" 2>"$OUT/bench-log.txt"
  echo "bench rc=$?" >> "$OUT/bench.txt"
fi
k=0
for p in $PROBES; do  # NAME or NAME.LOOP (ask-cpu.uvloop: the probe on that event loop)
  k=$((k + 1)); name=${p%%.*}; loop=(); [ "$name" != "$p" ] && loop=(--loop "${p#*.}")  # else the script's default
  timeout 240 python3 scripts/ring_probes.py "$name" "${loop[@]}" --gpu $GPU > "$OUT/probe-$k-$p.txt" 2>"$OUT/log-probe-$k-$p.txt"
  echo "probe $p rc=$?" >> "$OUT/probe-$k-$p.txt"
done
pgrep -af "nvidia-cuda-mps|meshd_mps" > "$OUT/left.txt" || echo "nothing left" > "$OUT/left.txt"
if [ -f "$OUT/gpu-tests.txt" ]; then grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/gpu-tests.txt" | tail -60; tail -3 "$OUT/gpu-tests.txt"; fi
cat "$OUT/ring-variants.txt" "$OUT/bench.txt" "$OUT"/probe-*.txt 2>/dev/null
