#!/usr/bin/env bash
# Three recurrent heads for SmolLM2-135M-Instruct on one GPU, from the same fit on different texts: answers to the
# package's instructions, answers to requests the target wrote itself, and both. On a GPU the target writes its texts
# in batches of 512, where this CPU writes 32 (docs/recurrent-drafter.md, "Requests the target writes itself").
#   bash experiments/gpu_heads.sh OUT [TEXTS] [STEPS] [GENERATE_BATCH]    (defaults: 9600 6000 512)
# Writes OUT/head-{target,package,both}.pt, their curves, the requests the target wrote and a log.
set -euo pipefail
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # a progress line every 10 s in the log
out=$1 texts=${2:-9600} steps=${3:-6000} batch=${4:-512}
cache=${SPECDEMO_TRAINING_CACHE:-/tmp/specdemo-training}
mkdir -p "$out"
for instructions in target package both; do
    count=$texts
    [ $instructions = both ] && count=$((2 * texts))  # half of each: the texts the two runs before wrote
    echo "== $instructions, $count texts: $(date -u +%T)" | tee -a "$out/log.txt"
    { python3 -m specdemo train-drafter --instructions $instructions --texts "$count" --generate-batch-size "$batch" \
        --batch-size 1024 --steps "$steps" --cache "$cache" --output "$out/head-$instructions.pt" \
        --curves "$out/curves-$instructions.png" 2>&1 || echo "== $instructions failed: $?"; } |
        stdbuf -oL tr '\r' '\n' | grep --line-buffered -v '^Loading weights' | tee -a "$out/log.txt"
    cp "$cache"/*/target-requests/requests.json "$out/requests.json" 2>/dev/null || true
done
echo "== done: $(date -u +%T)" | tee -a "$out/log.txt"
