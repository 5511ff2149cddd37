"""Static batches against continuous batching, SmolLM2 and the shipped drafter, one interleaved run.

    python examples/continuous_batching.py --num-prompts 32 --batch-sizes 8 --output bench/smollm2_cpu_continuous

Modes, on the same prompts (MT-bench first turns from `../shared/data`, else the package's), natural EOS:
- `static plain`: transformers' `generate`, batches of B prompts in order, each lasting as long as its slowest row;
- `static speculative`: `hf_specformer.generate` over the same batches (goodput scheduler, lookup on);
- `continuous speculative`: `hf_specformer.generate_batch(..., max_batch_size=B)` over all prompts at once.
Every answer is compared with static plain's. Writes OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hf_specformer import generate, generate_batch
from hf_specformer.assistants import load_drafter
from hf_specformer.batching import cut_after_eos, eos_token_ids, left_pad
from hf_specformer.prompts import chat_prompt_ids, find_shared_data, load_prompts
from hf_specformer.targets import load_target, load_tokenizer


def static(target, prompts: list[list[int]], batch_size: int, pad: int, eos: set[int], drafter=None,
           **generate_kwargs) -> list:
    """Answers of static batches of `batch_size` prompts (speculative with a drafter, plain `generate` without)."""
    answers = []
    for start in range(0, len(prompts), batch_size):
        input_ids, mask = left_pad(prompts[start: start + batch_size], pad)
        inputs = dict(input_ids=input_ids, attention_mask=mask, **generate_kwargs)
        output = target.generate(**inputs) if drafter is None else generate(target, assistant_model=drafter, **inputs)
        answers += [cut_after_eos(row, eos) for row in output[:, input_ids.shape[1]:].tolist()]
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    target, tokenizer = load_target(), load_tokenizer()
    drafter = load_drafter(None, target)
    texts = load_prompts(find_shared_data("spec_bench_mtbench.jsonl"), limit=args.num_prompts,
                         interleave_field="category")
    prompts = [chat_prompt_ids(tokenizer, text) for text in texts]
    pad, eos = tokenizer.pad_token_id, eos_token_ids(target, tokenizer)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    results = []
    for batch_size in args.batch_sizes:
        modes = {
            "static plain": lambda: static(target, prompts, batch_size, pad, eos, **common),
            "static speculative": lambda: static(target, prompts, batch_size, pad, eos, drafter, **common),
            "continuous speculative": lambda: [
                cut_after_eos(output.generated_tokens, eos)
                for output in generate_batch(target, prompts, assistant_model=drafter, max_batch_size=batch_size,
                                             **common)],
        }
        answers, seconds = {}, {}
        for name, run in modes.items():
            start = time.perf_counter()
            answers[name] = run()
            seconds[name] = time.perf_counter() - start
        tokens = sum(map(len, answers["static plain"]))
        for name in modes:
            row = {"batch_size": batch_size, "mode": name, "seconds": seconds[name], "tokens": tokens,
                   "tokens_per_second": tokens / seconds[name],
                   "speedup": seconds["static plain"] / seconds[name],
                   "rows_unlike_plain": sum(a != b for a, b in zip(answers[name], answers["static plain"]))}
            results.append(row)
            print(f"B={batch_size} {name}: {row['seconds']:.1f} s, {row['tokens_per_second']:.1f} tok/s, "
                  f"{row['speedup']:.2f}x, {row['rows_unlike_plain']} rows unlike plain", flush=True)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({
        "config": vars(args), "results": results,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    }, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    names = list(dict.fromkeys(row["mode"] for row in results))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        rows = [row for row in results if row["mode"] == name]
        axis.bar([i + index * width for i in range(len(rows))], [row["tokens_per_second"] for row in rows], width,
                 label=name)
    axis.set_xticks([i + width for i in range(len(args.batch_sizes))], [f"B = {b}" for b in args.batch_sizes])
    axis.set_ylabel("generated tokens/s")
    axis.legend()
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"))


if __name__ == "__main__":
    main()
