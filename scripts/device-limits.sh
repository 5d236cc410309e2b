#!/usr/bin/env bash
# Issue 14 on the GPU, through the CLI as a user would: as many resident heartbeats as each
# mode takes (blink 32, MPS 44 with --pool 4), every one beating; the next load refused (409);
# --nodes over the limits refused; a program that never starts rolled back; CUDA C compiled by
# the CLI, not the daemon.  Outputs land in $OUT (the device tool) or ./out.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
GPU=${GPU:-cuda}  # GPU=sim (with the stand-in first on PATH) tries the script on a CPU
M="python3 -m meshd_mps"
W=$(mktemp -d /tmp/meshd-limits.XXXXXX)
# One PTX for every copy (the CLI compiles CUDA C itself; here once, for speed).
python3 - "$W" <<'EOF'
import sys
from pathlib import Path
from meshd_mps.gpu.compiler import cuda_to_ptx
w = Path(sys.argv[1])
for name in ("heartbeat", "spin"):
    src = Path(f"examples/{name}/{name}.cu").read_bytes()
    (w / f"{name}.ptx").write_bytes(cuda_to_ptx(src, name, "compute_90", ["examples/include"]))
EOF
for iso in blink mps; do
  S=$W/$iso.sock; L="$OUT/limits-$iso.txt"  # $W is 0700: the daemon refuses a socket dir others can write
  if [ $iso = blink ]; then n=32; pool=0; else n=44; pool=4; fi
  $M serve --gpu $GPU --isolation $iso --pool $pool --socket $S --log-format console 2>/tmp/limits-$iso-log.txt &
  P=$!
  for i in $(seq 150); do $M status --socket $S >/dev/null 2>&1 && break; sleep 0.2; done
  {
    t0=$(date +%s)
    for i in $(seq 0 $((n - 1))); do
      echo "{\"name\": \"heartbeat-$i\", \"backend\": \"cuda\", \"warps\": 1, \"abi\": 1}" > $W/heartbeat-$i.json
      $M load --manifest $W/heartbeat-$i.json --ptx $W/heartbeat.ptx --socket $S >/dev/null || echo "load heartbeat-$i FAILED"
    done
    echo "loaded $n in $(( $(date +%s) - t0 )) s"
    sleep 2
    $M ps --socket $S --json > $W/ps-$iso.json
    python3 - $W/ps-$iso.json $n <<'EOF'
import json, sys
ps = json.load(open(sys.argv[1]))["programs"]
fresh = [p for p in ps if p["state"] == "running" and p.get("beat_age_s") is not None and p["beat_age_s"] < 1.0]
print(f"programs {len(ps)}, running and beating (beat age < 1 s): {len(fresh)} of {sys.argv[2]}")
print("states:", sorted({p["state"] for p in ps}), "largest beat age:", max((p.get("beat_age_s") or 0) for p in ps))
EOF
    echo '{"name": "one-more", "backend": "cuda", "warps": 1, "abi": 1}' > $W/one-more.json
    echo "== one more load:"; $M load --manifest $W/one-more.json --ptx $W/heartbeat.ptx --socket $S; echo "rc=$?"
    $M unload heartbeat-0 --socket $S
    echo '{"name": "wide", "backend": "cuda", "warps": 1, "abi": 1}' > $W/wide.json
    for nodes in 4294967296 1000000000 5000; do
      echo "== --nodes $nodes:"; $M load --manifest $W/wide.json --ptx $W/spin.ptx --nodes $nodes --socket $S; echo "rc=$?"
      $M unload wide --socket $S >/dev/null 2>&1
    done
    echo "== CUDA C through the API (refused) and through the CLI (compiled by the CLI):"
    python3 - $S <<'EOF'
import sys
from meshd_mps.serving.client import Client, ClientError
try:
    Client(sys.argv[1]).request("POST", "/v1/programs", {"manifest": {"name": "x", "backend": "cuda", "warps": 1, "abi": 1},
                                                        "cuda": '#include "/etc/passwd"\n'})
    print("ACCEPTED (wrong)")
except ClientError as e:
    print(e.status, e)
EOF
    $M load examples/spin --socket $S; echo "rc=$?"
    $M unload spin --socket $S
    $M ps --socket $S | tail -3
    $M status --socket $S | head -20
    kill -TERM $P; wait $P; echo "serve rc=$?"
    pgrep -af "nvidia-cuda-mps|meshd_mps worker" || echo "nothing left"
  } > "$L" 2>&1
  { echo "== the daemon's log (errors, warnings, limits)"; grep -iE "error|warn|refus|stall|start" /tmp/limits-$iso-log.txt | tail -n 40; } >> "$L"
done
rm -rf "$W"
tail -n 30 "$OUT"/limits-*.txt
