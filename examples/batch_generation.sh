#!/usr/bin/env bash
# Offline batch generation with speculative decoding: SmolLM2 answers a prompt file with the shipped drafter.
# Kill it at any point and run the same command again: it continues where it stopped.
# Results: $OUT/generations.jsonl (id, prompt, response) and $OUT/dataset (datasets, token ids included).
set -euo pipefail
PROMPTS=${PROMPTS:-../shared/data/spec_bench_mtbench.jsonl}
[ -f "$PROMPTS" ] || PROMPTS=""       # without it: the prompt set shipped in the package
OUT=${OUT:-runs/answers}

hf-specformer generate ${PROMPTS:+--prompts "$PROMPTS"} --output "$OUT" --max-new-tokens 256 --batch-size 16

# Several processes (one per GPU; on CPUs, ACCELERATE_USE_CPU=1 and --multi_gpu), each answering its share:
#   accelerate launch --num_processes 2 -m hf_specformer.apps.batch_job --prompts P.jsonl --output "$OUT"
# Sampling instead of greedy decoding (each batch seeded from --seed and its first prompt):
#   hf-specformer generate --prompts P.jsonl --output "$OUT-sampled" --do-sample --temperature 0.7 --top-p 0.9
