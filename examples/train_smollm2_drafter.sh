#!/usr/bin/env bash
# Self-distil SmolLM2-135M-Instruct, train a SpecFormer drafter on it, export the Hub folder, benchmark it.
# Prompts: ../shared/data/distill_prompts.jsonl when present, else the package's built-in prompt set.
set -euo pipefail
PROMPTS=${PROMPTS:-../shared/data/distill_prompts.jsonl}
[ -f "$PROMPTS" ] || PROMPTS=""
OUT=${OUT:-runs/smollm2}

hf-specformer distill ${PROMPTS:+--prompts "$PROMPTS"} --output "$OUT/distill" --max-new-tokens 256 --batch-size 32
# Resumable: re-run the same command after an interruption, or add --resume to the training command.
# CPU recipe: the slot stage and the feature loss at every reply position, the vocabulary-sized head at 24 of them,
# the frozen target's states kept in memory after the first epoch, drafts from the 8192 most frequent reply tokens.
accelerate launch --num_processes 1 --cpu -m hf_specformer.training.train_drafter --target smollm2 --data "$OUT/distill" \
    --output-dir "$OUT/train" --epochs 5 --per-device-batch-size 8 --learning-rate 7e-4 --min-learning-rate 3e-5 \
    --warmup-ratio 0.03 --positions-per-sequence 0 --ce-positions-per-sequence 24 --feature-loss-weight 0.005 \
    --cache-target-states --draft-vocab-size 8192 --max-length 640
hf-specformer export --drafter "$OUT/train/drafter" --output "$OUT/specformer-smollm2-135m-instruct" \
    --eval "$OUT/train/eval.json"
hf-specformer bench --drafter "$OUT/specformer-smollm2-135m-instruct" --oracle --output "$OUT/bench"
