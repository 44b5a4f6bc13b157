#!/usr/bin/env bash
# The first contact with a lent GPU, in one device call of at most 8 minutes (issue 34):
#     bash scripts/h200_check.sh            (from the repository root; the device tool's $OUT is kept)
# It uses the machine's own python3 (torch with CUDA; nothing is installed). Steps run most important
# first, each with its own time limit, and all of them within BUDGET seconds (480): a step that would
# start with less than 10 s left is skipped, and one that would run past the budget is cut to it. After
# every step the outputs are packed again, so a call stopped at any point still returns them. $OUT ends
# with three files: summary.txt (the figures against the targets, scripts/h200_summary.py),
# steps.txt (each step's exit status and seconds; rc=124: stopped at its limit) and h200-check.tar.gz
# (every log, the round and kernel JSONs, fixtures.json and the three measured profiles, which go into
# profiles/ as docs/engine.md says).
#
# Steps: facts; fixtures (the four checkpoint families through `remask generate` and a batched instance
# round); gpu-tests (pytest -m gpu); round, round-single, round-moe (`remask bench round`); recompute (`remask bench
# round --recompute`: a recompute round against a cached round of as many tokens, 128 to 2,048); kernels-8b,
# kernels-moe (tools/kernel_profile.py: device ms per round by kernel category); bench-engine; profile,
# profile-check (with its warm-up pass), profile-moe; profile-dg, profile-dg-check (DiffusionGemma-26B-A4B's
# shape, random weights: its first measured profile, about 40 s and 30 s on an H200); round-gaps.
#
# A dry run on a CPU (tests/test_h200_check.py runs it):  DEV=cpu SIZE=tiny OUT=/tmp/x bash scripts/h200_check.sh
# SIZE=tiny shrinks every shape to seconds a step; the steps that need CUDA say "skipped: no CUDA".
set -u
OUT=${OUT:-/tmp/remask-out}
PY=${PY:-python3}
DEV=${DEV:-cuda}
BUDGET=${BUDGET:-480}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/h200-check.XXXXXX")  # everything but the three files: packed into the tar
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
: >"$OUT/steps.txt"
T0=$SECONDS

if [ "${SIZE:-full}" = tiny ]; then
    M=${M:-"llada-8b-shape:layers=1,vocab=256,hidden=64,heads=2,kv_heads=2,intermediate=128"}
    M2=${M2:-"llada2-mini-shape:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128,vocab=256,experts=16"}
    MDG=${MDG:-"diffusiongemma-26b-a4b-shape:layers=2,hidden=64,heads=4,kv_heads=2,global_kv_heads=1,head_dim=16,\
global_head_dim=32,intermediate=96,vocab=256,window=16,experts=16,experts_per_token=4,moe_intermediate=32,canvas=32"}
    PROFILE_DG_ARGS="--batch-sizes 1,2 --prompt-lens 16,32 --max-tokens 32 --rounds 1" CHECK_DG_ARGS="--requests 1 --slots 1"
    SLOTS=4 SLOTS_MOE=4 TOKENS=8 CONTEXT=16 REPEATS=1 KROUNDS=1 CANVAS=64 RECOMPUTE_SIZES=64,128
    ENGINE_ARGS="--requests 2 --prompt-len 16 --gen-length 8"
    PROFILE_ARGS="--batch-sizes 1,2 --prompt-lens 16,32 --max-tokens 16 --rounds 1"
    PROFILE_MOE_ARGS=$PROFILE_ARGS CHECK_ARGS="--requests 3 --slots 2"
    FIX_ARCHS=${FIX_ARCHS:-sdar} FIX_TIMEOUT=60 DTYPE=${DTYPE:-float32}
else
    M=${M:-llada-8b-shape} M2=${M2:-llada2-mini-shape} MDG=${MDG:-diffusiongemma-26b-a4b-shape}
    SLOTS=128 SLOTS_MOE=32 TOKENS=32 CONTEXT=300 REPEATS=10 KROUNDS=5 CANVAS=128 RECOMPUTE_SIZES=128,256,512,1024,2048
    ENGINE_ARGS="--requests 16 --prompt-len 256 --gen-length 64"
    # 128 x 512 is the "fits" target: the profile lists it under meta.skipped when it runs out of memory
    # batches 1-16 of 64 + 64 tokens: recompute rounds of 128 to 2,048 tokens measured, not modelled (issue 39)
    PROFILE_ARGS="--batch-sizes 1,2,4,8,16,32,64,128 --prompt-lens 64,512 --max-tokens 64 --rounds 4"
    PROFILE_MOE_ARGS="--batch-sizes 1,8,32,128 --prompt-lens 64,512 --max-tokens 64 --rounds 3"
    CHECK_ARGS="--requests 64 --slots 32"
    # DiffusionGemma-26B-A4B's shape (52 GB of bf16 weights, random): one 256-token canvas per request, prompts of
    # 512 tokens (the curves' context) and 2,048 (the attention term); modelled rounds of 47-177 ms (denoise) and
    # 46-1,200 ms (prefill), so about 10 s of rounds, 40 s with the start. Batch 32 may run out of memory (its
    # float32 [32, 256, 262144] logits: 8.6 GB each): then meta.skipped says so. Each canvas runs to the rule's
    # 48-step cap (random logits are never confident): the check's 6 requests take about 30 s with its warm-up
    PROFILE_DG_ARGS="--batch-sizes 1,4,16,32 --prompt-lens 512,2048 --max-tokens 256 --rounds 4"
    CHECK_DG_ARGS="--requests 6 --slots 4"
    FIX_ARCHS=${FIX_ARCHS:-llada,dream,sdar,llada2} FIX_TIMEOUT=60
fi

pack() {  # the tar and the summary, again: a call stopped after this still returns both
    tar czf "$OUT/h200-check.tar.gz.part" -C "$WORK" --exclude=ckpt . 2>/dev/null \
        && mv "$OUT/h200-check.tar.gz.part" "$OUT/h200-check.tar.gz"
    cp "$OUT/steps.txt" "$WORK/steps.txt"
    $PY scripts/h200_summary.py "$WORK" >"$OUT/summary.txt" 2>&1
}

step() {  # step NAME SECONDS COMMAND...: run it within its limit and the budget, log to NAME.log, pack
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - (SECONDS - T0) - 10))  # 10 s kept for the last pack
    if [ "$left" -lt 10 ]; then
        echo "$name skipped: out of time (budget ${BUDGET}s)" | tee -a "$OUT/steps.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    local t=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t))s" | tee -a "$OUT/steps.txt"
    tail -n 8 "$WORK/$name.log"
    pack
}

skip() {  # skip NAME WHY: a step that cannot run here, said so
    echo "$1 skipped: $2" | tee -a "$OUT/steps.txt"
}

cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
step facts 30 bash -c "(nvidia-smi || echo 'nvidia-smi: not on this machine'); \
    $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA device\")'; \
    (git rev-parse --short HEAD 2>/dev/null || echo 'commit: not a git checkout')"
# 1. every family decodes on the device: `remask generate`, and a batched instance round of three prompts
step fixtures 120 $PY scripts/fixtures_check.py "$WORK/fixtures" --device "$DEV" --archs "$FIX_ARCHS" \
    --timeout "$FIX_TIMEOUT"
cp "$WORK/fixtures/fixtures.json" "$WORK/fixtures.json" 2>/dev/null
# 2. correctness on the device: the gpu-marked tests (bf16 against float32 on the CPU, graphs against eager)
if [ "$cuda" = 1 ]; then
    step gpu-tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu $(grep -l "mark.gpu" tests/test_*.py)
else
    skip gpu-tests "no CUDA"
fi
# 3. the round targets: LLaDA-8B shape 128 x 32 over 300, one request, LLaDA2-mini 32 x 32
step round 90 $PY -m tools.cli bench round --model "$M" --device "$DEV" --slots $SLOTS --tokens $TOKENS \
    --context $CONTEXT --repeats $REPEATS --json --out "$WORK/round.json"
step round-single 60 $PY -m tools.cli bench round --model "$M" --device "$DEV" --slots 1 --tokens $TOKENS \
    --context $CONTEXT --repeats $REPEATS --json --out "$WORK/round-single.json"
step round-moe 75 $PY -m tools.cli bench round --model "$M2" --device "$DEV" --slots $SLOTS_MOE --tokens $TOKENS \
    --context $CONTEXT --repeats $REPEATS --json --out "$WORK/round-moe.json"
# 3b. a recompute round of N tokens against a cached round of N tokens (target: within 1.2x), N = 128 .. 2,048,
# with the attention kernels flash-first (the engine's default) and cuDNN-first (torch's own on Hopper)
step recompute 75 $PY -m tools.cli bench round --recompute $RECOMPUTE_SIZES --canvas $CANVAS --model "$M" \
    --device "$DEV" --repeats 5 --json --out "$WORK/recompute.json"
# 4. where the round's device time goes, by kernel category (attention tested before matmul)
step kernels-8b 75 $PY -m tools.kernel_profile --model "$M" --device "$DEV" --slots $SLOTS --tokens $TOKENS \
    --context $CONTEXT --rounds $KROUNDS --out "$WORK/kernels-8b.json"
step kernels-moe 60 $PY -m tools.kernel_profile --model "$M2" --device "$DEV" --slots $SLOTS_MOE --tokens $TOKENS \
    --context $CONTEXT --rounds $KROUNDS --out "$WORK/kernels-moe.json"
# 5. the engine against the reference loops (batched >= 10x the best loop)
step bench-engine 120 $PY -m tools.cli bench engine --model "$M" --device "$DEV" --dtype ${DTYPE:-bfloat16} \
    $ENGINE_ARGS --quiet --json
# 6. the profiles the simulator, router and planner load, and the check of one against a real run
step profile 120 $PY -m tools.cli profile --model "$M" --device "$DEV" --name h200-llada8b-measured \
    $PROFILE_ARGS --out "$WORK/h200-llada8b-measured.json"
if [ -f "$WORK/h200-llada8b-measured.json" ]; then
    step profile-check 100 $PY -m tools.cli profile --model "$M" --device "$DEV" \
        --check "$WORK/h200-llada8b-measured.json" $CHECK_ARGS --json
else
    skip profile-check "no profile to check"
fi
step profile-moe 100 $PY -m tools.cli profile --model "$M2" --device "$DEV" --name h200-llada2mini-measured \
    $PROFILE_MOE_ARGS --out "$WORK/h200-llada2mini-measured.json"
# 6b. DiffusionGemma-26B-A4B's shape (random weights): the measured profile that replaces the modelled one
step profile-dg 90 $PY -m tools.cli profile --model "$MDG" --device "$DEV" --name h200-diffusiongemma-26b-a4b-measured \
    $PROFILE_DG_ARGS --out "$WORK/h200-diffusiongemma-26b-a4b-measured.json"
if [ -f "$WORK/h200-diffusiongemma-26b-a4b-measured.json" ]; then
    step profile-dg-check 60 $PY -m tools.cli profile --model "$MDG" --device "$DEV" \
        --check "$WORK/h200-diffusiongemma-26b-a4b-measured.json" $CHECK_DG_ARGS --json
else
    skip profile-dg-check "no profile to check"
fi
# 7. filler rows against copied contexts when 4 pool slots among the round's are held by other requests
step round-gaps 60 $PY -m tools.cli bench round --model "$M" --device "$DEV" --slots $SLOTS --tokens $TOKENS \
    --context $CONTEXT --repeats $REPEATS --gaps 4 --json --out "$WORK/round-gaps.json"
pack
echo "total $((SECONDS - T0))s of ${BUDGET}s" | tee -a "$OUT/steps.txt"
pack
cat "$OUT/summary.txt"
rm -rf "$WORK"
