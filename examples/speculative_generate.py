"""Batched speculative generation with the shipped SmolLM2 drafter, both ways in.

    python examples/speculative_generate.py

1. Hub style: `target.generate(..., assistant_model=draft, custom_generate=drafter_dir, trust_remote_code=True)`,
   which runs the drafter folder's `custom_generate/generate.py` (works without installing hf-specformer).
2. Package style: `hf_specformer.generate(target, ..., assistant_model=draft)`.
Both give exactly the target's own greedy output. Prompt lookup runs on top of the drafter by default;
`speculation_config={"lookup_ngram_size": 0, "schedule": "fixed"}` drafts with the drafter alone, k every step.
Sampling keeps the target's distribution.
"""

import torch
from transformers import AutoModel

import hf_specformer
from hf_specformer.targets import load_target, load_tokenizer, shipped_drafter_dir

torch.set_num_threads(2)
target, tokenizer = load_target("smollm2"), load_tokenizer("smollm2")
target.set_attn_implementation(hf_specformer.GQA_SDPA)  # verification without copies of the key/value heads
drafter_dir = str(shipped_drafter_dir())
draft = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True, dtype=torch.float32)

questions = ["What is the capital of France?", "Write a haiku about autumn.", "Explain recursion to a child."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
         for q in questions]
inputs = tokenizer(texts, return_tensors="pt", padding=True)  # left padding

hub_style = target.generate(**inputs, assistant_model=draft, custom_generate=drafter_dir, trust_remote_code=True,
                            max_new_tokens=64, do_sample=False, return_dict_in_generate=True)
package_style = hf_specformer.generate(target, **inputs, assistant_model=draft, max_new_tokens=64, do_sample=False)
plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)

assert torch.equal(hub_style.sequences, plain) and torch.equal(package_style, plain)
stats = hub_style.speculation_stats
print(f"identical to plain generate; tokens per target forward: {stats.tokens_per_step:.2f}, "
      f"acceptance by position: {[round(a, 2) for a in stats.acceptance_by_position]}, "
      f"drafts from prompt lookup: {stats.looked_up}")
drafter_only = hf_specformer.generate(target, **inputs, assistant_model=draft, max_new_tokens=64, do_sample=False,
                                      speculation_config={"lookup_ngram_size": 0, "schedule": "fixed"},
                                      return_dict_in_generate=True)
assert torch.equal(drafter_only.sequences, plain)
print(f"drafter alone, k every step: tokens per target forward {drafter_only.speculation_stats.tokens_per_step:.2f}")
for row in tokenizer.batch_decode(hub_style.sequences[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True):
    print("-", row.strip()[:200])

sampled = hf_specformer.generate(target, **inputs, assistant_model=draft, max_new_tokens=64, do_sample=True,
                                 temperature=0.7, top_p=0.9)  # lossless: the target's own sampling distribution
print(tokenizer.decode(sampled[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[:200])
