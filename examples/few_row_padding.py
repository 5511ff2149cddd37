"""What padding the few-row products to `linears.padded_rows` rows buys: target forwards and speculative `generate`,
with and without it, interleaved in one run.

    python examples/few_row_padding.py [--rounds 3] [--max-new-tokens 64] --output bench/smollm2_cpu_few_row_padding

On the CPU the engine computes the linear layers of inputs of up to 32 rows as W @ x^T (`generation/linears.py`).
MKL's cost for that product is not monotone in the rows: 2 rows cost less than 1, and beyond 8 rows a multiple of 8
costs less than the counts just below it. `padded_rows` adds zero rows up to the cheaper count. This script measures
the change where it acts, with the padding replaced by the identity for the "unpadded" variant (the code before it):

1. Forwards: SmolLM2 over a 256-token cache, B rows of T inputs each, both variants alternated, best of `--rounds`.
2. Calls: speculative `generate` (defaults: goodput schedule, prompt lookup, the shipped drafter, each variant with
   a step-cost cache of its own, empty at the start) and plain `generate`, at B = 1, 4, 8, 16 on MT-bench's first
   turns (the package's prompts without the shared data), rounds alternated, every row checked identical to plain.

Writes OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import matplotlib
import torch
from transformers import DynamicCache

from hf_specformer import generate
from hf_specformer.data.batching import left_pad
from hf_specformer.apps.drafter_eval import MTBENCH_PROMPTS
from hf_specformer.generation import linears
from hf_specformer.data.prompts import DEFAULT_PROMPTS_FILE, chat_prompt_ids, find_shared_data, labelled_prompts
from hf_specformer.targets import load_drafter
from hf_specformer.targets import load_target, load_tokenizer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHAPES = [(1, 1), (1, 4), (1, 5), (1, 7), (1, 10), (1, 13), (2, 1), (4, 3), (8, 2), (8, 3), (16, 1), (16, 2)]
"""(B, T) of the timed forwards: plain steps (T = 1), verification and draft-tree steps."""

VARIANTS = ("unpadded", "padded")


@contextlib.contextmanager
def products(variant: str):
    """The few-row products as they are ("padded") or with `padded_rows` the identity ("unpadded")."""
    if variant == "padded":
        yield
        return
    with mock.patch.object(linears, "padded_rows", lambda rows: rows):
        yield


def time_forwards(target, rounds: int, context: int = 256) -> list[dict]:
    """ms per target forward of B rows of T inputs over a `context`-token cache, per variant (best of `rounds`)."""
    seconds: dict[tuple, list[float]] = {}
    for batch_size in sorted({b for b, _ in SHAPES}):
        cache = DynamicCache(config=target.config)
        target(torch.randint(100, 40000, (batch_size, context)), past_key_values=cache, use_cache=True)
        for _ in range(rounds):
            for num_inputs in [t for b, t in SHAPES if b == batch_size]:
                step = torch.randint(100, 40000, (batch_size, num_inputs))
                for variant in VARIANTS:
                    with products(variant), linears.few_row_products([target], target.get_output_embeddings()):
                        start = time.perf_counter()
                        target(step, past_key_values=cache, use_cache=True)
                        seconds.setdefault((batch_size, num_inputs, variant), []).append(time.perf_counter() - start)
                    cache.crop(-num_inputs)
    return [{"batch_size": b, "inputs": t, "rows": b * t, "padded_to": linears.padded_rows(b * t),
             **{f"{variant}_ms": 1e3 * min(seconds[(b, t, variant)]) for variant in VARIANTS}} for b, t in SHAPES]


def time_calls(target, drafter, prompts: list[list[int]], batch_sizes: list[int], rounds: int,
               max_new_tokens: int, pad_token_id: int) -> list[dict]:
    """Seconds of plain and of speculative `generate` per variant over the same batches, rounds alternated."""
    caches = {variant: tempfile.mkdtemp(prefix=f"step_costs_{variant}_") for variant in VARIANTS}
    rows = []
    for batch_size in batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
        totals = {name: 0.0 for name in ("plain", *VARIANTS)}
        mismatched = 0
        for round_index in range(rounds):
            order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            for batch in batches:
                ids, mask = left_pad(batch, pad_token_id)
                kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad_token_id)
                start = time.perf_counter()
                plain = target.generate(**kwargs)
                totals["plain"] += time.perf_counter() - start
                for variant in order:
                    os.environ["HF_SPECFORMER_CACHE"] = caches[variant]
                    with products(variant):
                        start = time.perf_counter()
                        output = generate(target, assistant_model=drafter, **kwargs)
                        totals[variant] += time.perf_counter() - start
                    mismatched += int((output != plain).any(dim=1).sum())
        rows.append({"batch_size": batch_size, "rows": len(batches) * batch_size, "mismatched_rows": mismatched,
                     **{f"{name}_seconds": seconds for name, seconds in totals.items()},
                     **{f"{variant}_speedup": totals["plain"] / totals[variant] for variant in VARIANTS}})
        print(rows[-1], flush=True)
    return rows


def plot(report: dict, path: Path) -> None:
    figure, (forwards, calls) = plt.subplots(2, 1, figsize=(9, 8))
    labels = [f"B={row['batch_size']} T={row['inputs']}\n{row['rows']}->{row['padded_to']}"
              for row in report["forwards"]]
    positions = range(len(labels))
    for offset, variant in ((-0.2, "unpadded"), (0.2, "padded")):
        forwards.bar([p + offset for p in positions], [row[f"{variant}_ms"] for row in report["forwards"]], 0.4,
                     label=variant)
    forwards.set_xticks(list(positions), labels, fontsize=7)
    forwards.set_ylabel("ms per target forward")
    forwards.set_title("SmolLM2 forwards, few-row products with and without padding (rows -> padded rows)")
    forwards.legend()
    sizes = [str(row["batch_size"]) for row in report["calls"]]
    for offset, variant in ((-0.2, "unpadded"), (0.2, "padded")):
        calls.bar([p + offset for p in range(len(sizes))], [row[f"{variant}_speedup"] for row in report["calls"]],
                  0.4, label=variant)
    calls.axhline(1.0, color="grey", linewidth=0.8)
    calls.set_xticks(range(len(sizes)), sizes)
    calls.set_xlabel("batch size")
    calls.set_ylabel("speed-up over plain generate")
    calls.set_title("speculative generate (defaults), interleaved with plain generate")
    calls.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timings of each forward (the best is kept)")
    parser.add_argument("--call-rounds", type=int, default=2, help="timings of each batch's calls (summed)")
    parser.add_argument("--output", default="bench/few_row_padding")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_target()
    tokenizer = load_tokenizer()
    drafter = load_drafter(args.drafter, target)
    source = find_shared_data(MTBENCH_PROMPTS) or str(DEFAULT_PROMPTS_FILE)
    prompts = [chat_prompt_ids(tokenizer, p) for p in labelled_prompts([source], "category")[0][: args.num_prompts]]
    report = {"config": vars(args), "prompts": source, "threads": torch.get_num_threads(),
              "forwards": time_forwards(target, args.rounds)}
    for row in report["forwards"]:
        print(row, flush=True)
    report["calls"] = time_calls(target, drafter, prompts, args.batch_sizes, args.call_rounds, args.max_new_tokens,
                                 tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, output.with_suffix(".png"))
    print(f"wrote {output.with_suffix('.json')} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
