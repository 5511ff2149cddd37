"""Static batches against continuous batching, SmolLM2 and the shipped drafter, one interleaved run.

    python examples/continuous_batching.py --num-prompts 256 --batch-sizes 16 32 --max-new-tokens 256 \
        --output bench/smollm2_cpu_batch_job

Prompts: MT-bench first turns (taken round-robin over its categories) alternating with the project's own prompts
(`distill_prompts.jsonl`, shuffled, at most `--max-prompt-tokens` in the chat template), both from `../shared/data`,
else the package's, then the project's own alone once MT-bench's are used; `--prompt-set mtbench` takes MT-bench
alone. Natural EOS. Modes, on the same prompts:
- `static plain`: transformers' `generate`, batches of B prompts in order, each lasting as long as its slowest row;
- `transformers generate_batch`: transformers' continuous batching (paged cache), at most B requests per step;
- `static speculative`: `hf_specformer.generate` over the same batches (goodput scheduler, lookup on);
- `continuous plain`: `hf_specformer.generate_batch(..., max_batch_size=B)` without a drafter (our engine's plain
  steps);
- `continuous speculative`: `hf_specformer.generate_batch(..., assistant_model=drafter, max_batch_size=B)`.
Every answer is compared with static plain's. Writes OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_specformer import generate, generate_batch
from hf_specformer.targets import load_drafter
from hf_specformer.data.batching import cut_after_eos, eos_token_ids, left_pad
from hf_specformer.data.prompts import chat_prompt_ids, find_shared_data, load_prompts
from hf_specformer.targets import describe_machine, load_target, load_tokenizer
from transformers import ContinuousBatchingConfig, GenerationConfig


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


def continuous(target, prompts: list[list[int]], batch_size: int, eos: set[int], drafter=None,
               **generate_kwargs) -> list:
    """Answers of `hf_specformer.generate_batch` with `batch_size` slots (speculative with a drafter), and kappa."""
    outputs = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=batch_size, progress_bar=False,
                             **generate_kwargs)
    steps = sum(output.steps for output in outputs)
    kappa = (steps + sum(output.accepted_drafts for output in outputs)) / steps if steps else 1.0
    return [cut_after_eos(output.generated_tokens, eos) for output in outputs], kappa


def transformers_continuous(target, prompts: list[list[int]], batch_size: int, eos: set[int], max_new_tokens: int,
                            pad_token_id: int, **_) -> list:
    """Answers of transformers' own `generate_batch` (continuous batching, at most `batch_size` requests a step)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
                              eos_token_id=sorted(eos))
    outputs = target.generate_batch(prompts, generation_config=config, progress_bar=False,
                                    continuous_batching_config=ContinuousBatchingConfig(
                                        max_requests_per_batch=batch_size))
    by_index = {int(request_id.rsplit("_", 1)[1]): output for request_id, output in outputs.items()}
    return [cut_after_eos(by_index[index].generated_tokens, eos) for index in range(len(prompts))]


def mixed_prompts(tokenizer, count: int, prompt_set: str, max_prompt_tokens: int) -> list[list[int]]:
    """Chat-template ids of `count` prompts: MT-bench first turns alone, or alternating with the project's own (then
    the project's own alone once MT-bench's 80 are used)."""
    mtbench = load_prompts(find_shared_data("spec_bench_mtbench.jsonl"), interleave_field="category")
    if prompt_set == "mtbench":
        return [chat_prompt_ids(tokenizer, text) for text in mtbench[:count]]
    own = (chat_prompt_ids(tokenizer, text)
           for text in load_prompts(find_shared_data("distill_prompts.jsonl"), shuffle_seed=7))
    own = [ids for ids in own if len(ids) <= max_prompt_tokens]
    mtbench = [chat_prompt_ids(tokenizer, text) for text in mtbench]
    mixed = [ids for pair in zip(mtbench, own) for ids in pair] + own[len(mtbench):]
    if len(mixed) < count:
        raise ValueError(f"{len(mixed)} mixed prompts available, {count} asked for")
    return mixed[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-set", choices=["mixed", "mtbench"], default="mixed")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    target, tokenizer = load_target(), load_tokenizer()
    drafter = load_drafter(None, target)
    prompts = mixed_prompts(tokenizer, args.num_prompts, args.prompt_set, args.max_prompt_tokens)
    pad, eos = tokenizer.pad_token_id, eos_token_ids(target, tokenizer)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    static(target, prompts[:2], 2, pad, eos, **{**common, "max_new_tokens": 4})  # first-call set-up off the clock
    results = []
    for batch_size in args.batch_sizes:
        modes = {
            "static plain": lambda: static(target, prompts, batch_size, pad, eos, **common),
            "transformers generate_batch": lambda: transformers_continuous(target, prompts, batch_size, eos,
                                                                            **common),
            "static speculative": lambda: static(target, prompts, batch_size, pad, eos, drafter, **common),
            "continuous plain": lambda: continuous(target, prompts, batch_size, eos, None, **common),
            "continuous speculative": lambda: continuous(target, prompts, batch_size, eos, drafter, **common),
        }
        answers, seconds, kappas = {}, {}, {}
        for name, run in modes.items():
            start = time.perf_counter()
            answers[name] = run()
            seconds[name] = time.perf_counter() - start
            if isinstance(answers[name], tuple):
                answers[name], kappas[name] = answers[name]
        tokens = sum(map(len, answers["static plain"]))
        for name in modes:
            row = {"batch_size": batch_size, "mode": name, "seconds": seconds[name], "tokens": tokens,
                   "tokens_per_second": tokens / seconds[name],
                   "speedup": seconds["static plain"] / seconds[name],
                   "speedup_vs_transformers_generate_batch": seconds["transformers generate_batch"] / seconds[name],
                   "kappa": kappas.get(name),
                   "rows_unlike_plain": sum(a != b for a, b in zip(answers[name], answers["static plain"]))}
            results.append(row)
            print(f"B={batch_size} {name}: {row['seconds']:.1f} s, {row['tokens_per_second']:.1f} tok/s, "
                  f"{row['speedup']:.2f}x static plain, {row['speedup_vs_transformers_generate_batch']:.2f}x "
                  f"generate_batch, {row['rows_unlike_plain']} rows unlike plain", flush=True)
        write(Path(args.output), vars(args), results)


def write(output: Path, config: dict, results: list[dict]) -> None:
    """OUTPUT.json (configuration, results, machine) and OUTPUT.png (tokens/s by mode and batch size)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({
        "config": config, "results": results,
        "machine": describe_machine(),
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
    batch_sizes = list(dict.fromkeys(row["batch_size"] for row in results))
    axis.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(batch_sizes))],
                    [f"B = {b}" for b in batch_sizes])
    axis.set_ylabel("generated tokens/s")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"))


if __name__ == "__main__":
    main()
