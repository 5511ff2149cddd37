#!/usr/bin/env bash
# The recipe of the shipped SmolLM2 drafter, on one GPU (an H100: 8.5 min generating data, 11 min training):
#   1. the target writes user prompts itself (Magpie),   2. it answers them and the shared prompt set greedily,
#   3. the drafter trains on the answers (bf16 autocast, every reply position, batches of 64 sequences),
#   4. a shorter second stage continues at a lower learning rate,
#   5. a third stage adds the next-token input (--next-token-input, an extension of the paper: each position also
#      reads the token after it, so slot 1 sees the correction/bonus token); the shipped drafter ran it on the CPU:
#        python -m hf_specformer.training.train_drafter --data "$OUT/distill" --output-dir "$OUT/train3" --init-from "$OUT/train2/drafter" \
#          --next-token-input --new-parameter-learning-rate-scale 10 --max-steps 400 --per-device-batch-size 8 \
#          --positions-per-sequence 32 --ce-positions-per-sequence 16 --max-length 512 --learning-rate 1e-4 \
#          --warmup-ratio 0.03 --eval-fraction 0.005 --eval-every 0 --save-every 40 --num-threads 2 --save-dtype float32
#   6. export with an 8192-token draft vocabulary.
# (The shipped run distilled in two sittings: stage 1 saw the first 11,264 answers, stage 2 all 16,384.)
# Every step resumes when run again after an interruption (SIGTERM makes training checkpoint and stop cleanly;
# add --resume to the training command to continue). Prompts: ../shared/data/distill_prompts.jsonl when present.
set -euo pipefail
PROMPTS=${PROMPTS:-../shared/data/distill_prompts.jsonl}
[ -f "$PROMPTS" ] || PROMPTS=""
OUT=${OUT:-runs/smollm2-gpu}
STEPS=${STEPS:-2153}  # the shipped run: ~12 epochs of 11K answers; set it from your GPU's step time and budget
# As in the shipped run: TF32 matmuls make generation faster; a greedy answer can then leave the float32 target's
# path after a near-tie, which costs the drafter little. Unset it for answers exactly as float32 gives them.
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=${TORCH_ALLOW_TF32_CUBLAS_OVERRIDE:-1}

hf-specformer synthesize --output "$OUT/self_prompts.jsonl" --num-prompts 16000 --batch-size 1024 --max-new-tokens 128
hf-specformer distill ${PROMPTS:+--prompts "$PROMPTS"} --prompts "$OUT/self_prompts.jsonl" --output "$OUT/distill" \
    --batch-size 1024 --max-new-tokens 256
COMMON=(--data "$OUT/distill" --per-device-batch-size 64 --mixed-precision bf16 --positions-per-sequence 0
        --min-learning-rate 1e-5 --warmup-ratio 0.03 --eval-fraction 0.005 --eval-every 0 --save-every 250
        --save-dtype float32 --max-length 768 --draft-length 8)
accelerate launch -m hf_specformer.training.train_drafter "${COMMON[@]}" --output-dir "$OUT/train" --max-steps "$STEPS" \
    --learning-rate 5e-4
accelerate launch -m hf_specformer.training.train_drafter "${COMMON[@]}" --output-dir "$OUT/train2" --max-steps 560 \
    --learning-rate 1.5e-4 --init-from "$OUT/train/drafter"
accelerate launch -m hf_specformer.training.train_drafter "${COMMON[@]}" --output-dir "$OUT/train3" --max-steps "${STEPS3:-1000}" \
    --learning-rate 1e-4 --init-from "$OUT/train2/drafter" --next-token-input --new-parameter-learning-rate-scale 10
hf-specformer export --drafter "$OUT/train3/drafter" --output "$OUT/specformer-smollm2-135m-instruct" \
    --eval "$OUT/train3/eval.json" --draft-vocab-size 8192 --draft-vocab-data "$OUT/distill"
