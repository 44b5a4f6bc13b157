#!/usr/bin/env bash
# Issue 10's device run: one call on a lent H200 that checks the CUDA path and measures the targets.
# Run by the device tool from the repository root:   bash scripts/h200_check.sh
# It uses the machine's own python3 (torch with CUDA; nothing is installed) and writes everything
# under $OUT: logs, round.json and the measured profiles. About 6-9 minutes; each step has its own
# time limit so one failure leaves the rest to run (run it with the 600 s call limit: steps are in order
# of importance, and a stopped call still returns what is under $OUT). Copy the profiles into profiles/.
set -u
OUT=${OUT:-/tmp/remask-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
PY=${PY:-python3}
# a dry run on a CPU: M="llada-8b-shape:layers=1,vocab=512,hidden=128,heads=4,kv_heads=4,intermediate=256" DEV=cpu
#   M2="llada2-mini-shape:layers=2,hidden=128,heads=4,kv_heads=2,head_dim=32,intermediate=256,vocab=512,experts=16"
M=${M:-llada-8b-shape}
DEV=${DEV:-cuda}
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, record the exit status
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
    tail -n 15 "$OUT/$name.log"
}
step facts 60 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
# Most important first: a call stopped at its limit still returns what is under $OUT.
# 1. correctness on the device: bf16 runner against float32 on the CPU, a round's launch never waits,
#    graph replays equal eager forwards, and the engine with CUDA graphs decodes the eager tokens
step gpu-tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_runner.py tests/test_bench_engine.py \
    tests/test_graphs.py
# 2. the round target: 128 slots x 32 tokens over 300 cached tokens, LLaDA-8B shape (<= 110 ms)
step round 150 $PY -m tools.cli bench round --model $M --device $DEV --json --out "$OUT/round.json"
# the same round for one request: launch-bound, what single-request latency is made of
step round-single 60 $PY -m tools.cli bench round --model $M --device $DEV --slots 1 --json --out "$OUT/round-single.json"
# 3. the engine against the reference loops (batched >= 10x, single-request latency <= Fast-dLLM loop)
step bench-engine 200 $PY -m tools.cli bench engine --model $M --device $DEV --dtype ${DTYPE:-bfloat16} --requests 16 \
    --prompt-len 256 --gen-length 64 --quiet --json
# 4. the profile the simulator, router and planner load (block and recompute rounds, two contexts)
step profile 150 $PY -m tools.cli profile --model $M --device $DEV --name h200-llada8b-measured \
    --batch-sizes 1,4,16,32,64,128 --prompt-lens 64,512 --max-tokens 64 --rounds 4 \
    --out "$OUT/h200-llada8b-measured.json"
# 5. the profile against a recorded real run (within 10%)
step profile-check 100 $PY -m tools.cli profile --model $M --device $DEV --check "$OUT/h200-llada8b-measured.json" \
    --requests 64 --slots 32 --json
# 6. filler rows against copied contexts when 4 of 132 pool slots are held by requests not in the round
#    (checks the runner's FLOPs-per-byte balance for CUDA, engine/runner.py BALANCE)
step round-gaps 120 $PY -m tools.cli bench round --model $M --device $DEV --gaps 4 --json --out "$OUT/round-gaps.json"
# 7. LLaDA2.0-mini's shape (mixture of experts, block-causal): a round with the experts in grouped products
#    (the CUDA default) against a padded grid and the per-expert loop, and a profile
M2=${M2:-llada2-mini-shape}
step round-moe 120 $PY -m tools.cli bench round --model $M2 --device $DEV --slots 32 --json --out "$OUT/round-moe.json"
step profile-moe 150 $PY -m tools.cli profile --model $M2 --device $DEV --name h200-llada2mini-measured \
    --batch-sizes 1,8,32,128 --prompt-lens 64,512 --max-tokens 64 --rounds 3 \
    --out "$OUT/h200-llada2mini-measured.json"
cat "$OUT/steps.txt"
# the figures against the targets (also in $OUT/summary.txt)
$PY scripts/h200_summary.py "$OUT" | tee "$OUT/summary.txt"
