"""Speculative Verification: the goodput scheduler, with and without the shipped SmolLM2 companion.

    python examples/speculative_verification.py

Each step the scheduler estimates, for every row and drafted position, the chance that the drafts up to there are
all accepted (from the drafter's calibrated confidence, or from the companion's (S, A) signals), and verifies the
number of drafts per row that maximises expected committed tokens per second under step costs learnt from the
call's own steps. Width 0 is a plain step; a call that falls behind plain decoding is handed over to plain steps.
Outputs are always the target's own: the schedule only decides what to verify.
"""

import torch
from transformers import AutoModel

import hf_specformer
from hf_specformer.targets import load_target, load_tokenizer, shipped_companion_dir, shipped_drafter_dir

torch.set_num_threads(2)
target, tokenizer = load_target("smollm2"), load_tokenizer("smollm2")
target.set_attn_implementation(hf_specformer.GQA_SDPA)  # verification without copies of the key/value heads
draft = AutoModel.from_pretrained(shipped_drafter_dir(), trust_remote_code=True, dtype=torch.float32)
companion = AutoModel.from_pretrained(shipped_companion_dir(), trust_remote_code=True, dtype=torch.float32)

questions = ["List the planets of the solar system.", "Write a haiku about autumn.", "What is 17 times 23?",
             "Explain recursion to a child.", "Name three uses of copper.", "Translate 'good morning' into French.",
             "Summarise the plot of Hamlet in two sentences.", "Give a Python function that reverses a string."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
         for q in questions]
inputs = tokenizer(texts, return_tensors="pt", padding=True)  # left padding
plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)

for label, kwargs in {"fixed k": dict(speculation_config={"schedule": "fixed"}), "goodput (drafter confidence)": {},
                      "goodput (SV companion)": dict(companion_model=companion)}.items():
    for size in (1, len(questions)):
        batch = {name: tensor[:size] for name, tensor in inputs.items()}
        out = hf_specformer.generate(target, **batch, assistant_model=draft, max_new_tokens=64, do_sample=False,
                                     return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, target.generate(**batch, max_new_tokens=64, do_sample=False)
                           if size == 1 else plain)
        stats = out.speculation_stats
        predicted = f", predicted acceptance {stats.predicted_acceptance_rate:.2f} vs realised " \
            f"{stats.acceptance_rate:.2f}" if stats.predicted_accepted else ""
        what = f"widths chosen {stats.width_counts}{predicted}, hand-offs to plain steps {stats.handoffs}"
        print(f"{label}, B = {size}: identical to plain generate; kappa {stats.tokens_per_step:.2f}, "
              f"{stats.drafts_per_step:.2f} drafts verified per step; {what}")
