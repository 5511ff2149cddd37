#!/usr/bin/env bash
# Adapt the shipped SmolLM2 drafter to a domain it was not trained on (small Python coding tasks) with a LoRA
# adapter, and report kappa before and after on held-out answers of that domain (eval.json: "initial" vs final).
#   1. make the domain's prompts; 2. the target answers them (self-distillation, resumable);
#   3. `train --lora` from the shipped drafter: LoRA on every linear layer of the drafter, its weights frozen;
#      writes runs/code_lora/adapter (PEFT) and runs/code_lora/drafter (merged, a complete Hub folder).
set -euo pipefail
OUT=${OUT:-runs}
DRAFTER=$(python -c "from hf_specformer.targets import shipped_drafter_dir; print(shipped_drafter_dir())")

python examples/make_code_prompts.py "$OUT/code_prompts.jsonl"
hf-specformer distill --prompts "$OUT/code_prompts.jsonl" --output "$OUT/distill_code" --max-new-tokens 160 \
    --batch-size 32
hf-specformer train --lora --init-from "$DRAFTER" --draft-length 8 --data "$OUT/distill_code" \
    --output-dir "$OUT/code_lora" --eval-fraction 0.15 --epochs "${EPOCHS:-3}" --per-device-batch-size 8 \
    --learning-rate 2e-3 --min-learning-rate 1e-4 --lora-rank 16 --positions-per-sequence 64 \
    --ce-positions-per-sequence 24 --cache-target-states --max-length 640 --eval-every 0 --save-every 20
python - "$OUT/code_lora/eval.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for k in (1, 3, 8):
    print(f"k={k}: kappa {report['initial']['kappa'][k - 1]:.3f} (shipped drafter) -> "
          f"{report['kappa'][k - 1]:.3f} (LoRA-adapted)")
PY
