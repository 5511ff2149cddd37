#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (about 3 minutes on an H100):
#   1. the engine's and GQA_SDPA's equality tests with the tiny float64 models on CUDA
#      (HF_SPECFORMER_TEST_DEVICE=cuda);
#   2. the `gpu`-marked tests: Triton kernels compiled for the device, and the loop's waits under sync debug mode;
#   3. the host-overhead bench, and the bench on a random-weight model of SmolLM2's shape in bfloat16 (timings only:
#      an oracle and an untrained drafter), for hosts where the GGUF file cannot be brought;
#   4. what a CUDA graph of the verification forward would save the host (examples/cuda_graph_verify.py, ~2 min).
# Usage: bash examples/gpu_checks.sh [OUTPUT_DIR]   (needs pytest-xdist; writes logs, JSON and PNG to OUTPUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_checks}
mkdir -p "$out" "$out/smollm2-shape"
export PYTHONUNBUFFERED=1
HF_SPECFORMER_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q --tb=short -n 8 \
  tests/generation tests/test_attention.py 2>&1 | tee "$out/cuda_equality.log" | tail -3
python3 -m pytest -p no:cacheprovider -q --tb=short -m gpu tests 2>&1 | tee "$out/gpu_marker.log" | tail -3
hf-specformer bench --host-overhead --output "$out/host_overhead_cuda"
python3 - "$out/smollm2-shape" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from hf_specformer.targets import SMOLLM2_GGUF_FILE, load_tokenizer, smollm2_directory

folder = sys.argv[1]
torch.manual_seed(0)
config = AutoConfig.from_pretrained(smollm2_directory(), gguf_file=SMOLLM2_GGUF_FILE)
AutoModelForCausalLM.from_config(config).save_pretrained(folder)
load_tokenizer().save_pretrained(folder)
PY
hf-specformer bench --target "$out/smollm2-shape" --oracle --drafter untrained --schedules goodput \
  --dtype bfloat16 --device cuda --batch-sizes 1 16 64 --max-new-tokens 32 --min-rows 4 \
  --output "$out/smollm2_shape_random_cuda_bf16"
python3 examples/cuda_graph_verify.py --output "$out/qwen3_4b_shape_graph_cuda"
