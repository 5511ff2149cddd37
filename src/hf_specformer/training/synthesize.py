"""Prompts written by the target itself (`hf-specformer synthesize`), as Magpie (arXiv 2406.08464) does: given the
opening of a user turn, the target samples a user message (kept if it closed the turn and is new); resumable, batch b
seeded by (seed, b), with a category's system prompt per batch."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_specformer.data.batching import batch_seed, cut_after_eos, eos_token_ids
from hf_specformer.data.prompts import load_prompts
from hf_specformer.data.records import (append_records, check_or_write_meta, prompts_sha256, read_records,
                                        target_fingerprint)
from hf_specformer.targets import add_target_arguments, target_from_args

logger = logging.getLogger(__name__)

SENTINEL = "\u2063USER-MESSAGE\u2063"
CATEGORY_SYSTEM_PROMPTS = {
    "writing": "You are an AI assistant for writing. Users ask you to write stories, poems, essays, emails, blog "
               "posts and speeches, or to improve a text they give you.",
    "roleplay": "You are an AI assistant for role-play. Users ask you to act as a character, a profession or a "
                "famous person and to answer in that voice.",
    "reasoning": "You are an AI assistant for reasoning. Users give you puzzles, riddles, logic problems and "
                 "questions that need careful step-by-step thinking.",
    "math": "You are an AI assistant for mathematics. Users ask you to solve arithmetic, algebra, geometry, "
            "probability and word problems and to explain the steps.",
    "coding": "You are an AI assistant for programming. Users ask you to write, explain, fix or review code in "
              "Python, JavaScript, C++, SQL and other languages.",
    "extraction": "You are an AI assistant for information extraction. Users paste a text and ask you to pull out "
                  "names, dates, numbers or facts, often as a list, a table or JSON.",
    "stem": "You are an AI assistant for science and engineering. Users ask about physics, chemistry, biology, "
            "medicine, computing and engineering.",
    "humanities": "You are an AI assistant for the humanities. Users ask about history, philosophy, literature, "
                  "art, economics, law and society.",
    "translation": "You are an AI assistant for translation. Users give you a sentence or a paragraph and ask you "
                   "to translate it into another language.",
    "summarization": "You are an AI assistant for summaries. Users paste a long passage of several paragraphs and "
                     "ask you to summarise it.",
    "passage_qa": "You are an AI assistant for reading comprehension. Users paste a long passage of several "
                  "paragraphs and ask a question that it answers.",
}
"""Category -> the system prompt that steers what users ask (MT-bench's 8 categories, translation, and requests
over long passages)."""

MAX_FRUITLESS_BATCHES = 10
"""Consecutive batches that keep no message after which synthesis gives up (a target that never closes a turn)."""


def user_turn_prefix_ids(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins, with `system_prompt` (None: the
    template's default); found by rendering a sentinel message."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    text = tokenizer.apply_chat_template([*system, {"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise ValueError("The chat template does not contain the user message verbatim; cannot find the user turn.")
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def sample_user_messages(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prefix_ids: list[int],
                         batch_size: int, max_new_tokens: int, seed: int) -> list[str | None]:
    """`batch_size` user messages sampled after `prefix_ids`; None for a message the target did not close in time."""
    torch.manual_seed(seed)
    input_ids = torch.tensor([prefix_ids] * batch_size, device=target.device)
    output = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
    eos_ids = eos_token_ids(target, tokenizer)
    messages = []
    for row in output[:, input_ids.shape[1] :].tolist():
        message = cut_after_eos(row, eos_ids)
        closed = bool(message) and message[-1] in eos_ids
        messages.append(tokenizer.decode(message[:-1], skip_special_tokens=True).strip() if closed else None)
    return messages


def synthesize_prompts(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, num_prompts: int, output_path: str,
                       *, batch_size: int = 64, max_new_tokens: int = 128, seed: int = 0,
                       categories: list[str] | None = None, exclude: Iterable[str] = (),
                       progress: bool = True) -> list[str]:
    """Has `target` write `num_prompts` distinct user prompts into `output_path` (JSONL), resuming a matching run,
    and returns them; `categories` (keys of `CATEGORY_SYSTEM_PROMPTS`) in turn per batch, `exclude` never written."""
    if num_prompts < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("num_prompts, batch_size and max_new_tokens must be positive.")
    unknown = sorted(set(categories or []) - set(CATEGORY_SYSTEM_PROMPTS))
    if unknown or categories == []:
        raise ValueError(f"Unknown categories {unknown}; choose from {sorted(CATEGORY_SYSTEM_PROMPTS)}.")
    directory = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(directory, exist_ok=True)
    excluded = {prompt.strip() for prompt in exclude}
    meta = {**target_fingerprint(target), "seed": seed, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
            **({"categories": categories} if categories else {}),
            **({"excluded_sha256": prompts_sha256(sorted(excluded))} if excluded else {})}
    check_or_write_meta(output_path + ".meta.json", meta)
    records = sorted(read_records(output_path).values(), key=lambda record: record["id"])
    prompts = [record["prompt"] for record in records]
    seen = set(prompts) | excluded
    batch_index = max((record["batch"] for record in records), default=-1) + 1
    kinds = categories or [None]
    prefixes = {kind: user_turn_prefix_ids(tokenizer, CATEGORY_SYSTEM_PROMPTS.get(kind)) for kind in kinds}

    bar = tqdm(total=num_prompts, initial=min(len(prompts), num_prompts), unit="prompt", desc="synthesize",
               disable=not progress)
    sampled = fruitless = 0
    while len(prompts) < num_prompts:
        if fruitless == MAX_FRUITLESS_BATCHES:
            raise RuntimeError(
                f"The last {fruitless * batch_size} sampled user messages gave no new prompt (none closed within "
                f"{max_new_tokens} tokens, or all blank or repeated); is the target an instruction-tuned chat model?"
            )
        kind = kinds[batch_index % len(kinds)]
        messages = sample_user_messages(target, tokenizer, prefixes[kind], batch_size, max_new_tokens,
                                        batch_seed(seed, batch_index))
        source = f"self:{target.config.name_or_path}" + (f":{kind}" if kind else "")
        new = []
        for message in messages:
            if message and message not in seen and len(prompts) + len(new) < num_prompts:
                seen.add(message)
                new.append({"id": len(prompts) + len(new), "batch": batch_index, "source": source, "prompt": message,
                            **({"category": kind} if kind else {})})
        append_records(output_path, new)
        prompts.extend(record["prompt"] for record in new)
        sampled += len(messages)
        fruitless = 0 if new else fruitless + 1
        batch_index += 1
        bar.update(len(new))
        bar.set_postfix(sampled=sampled)
    bar.close()
    return prompts[:num_prompts]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of `hf-specformer synthesize`."""
    parser = argparse.ArgumentParser(prog="hf-specformer synthesize", description=__doc__.split("\n\n")[0])
    add_target_arguments(parser)
    parser.add_argument("--output", required=True, help="JSONL file of prompts (resumed if it exists)")
    parser.add_argument("--num-prompts", type=int, required=True, help="distinct prompts to write")
    parser.add_argument("--batch-size", type=int, default=64, help="messages sampled per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest message (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--categories", nargs="+", default=None, metavar="CATEGORY",
                        help="steer batches in turn by category system prompts (`all`: "
                        f"{', '.join(CATEGORY_SYSTEM_PROMPTS)})")
    parser.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                        help="prompt files (as `distill --prompts` reads them) whose prompts are never written: "
                        "earlier sets")
    args = parser.parse_args(argv)
    if args.categories == ["all"]:
        args.categories = list(CATEGORY_SYSTEM_PROMPTS)
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hf-specformer synthesize`."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    exclude = load_prompts(args.exclude) if args.exclude else []
    target, tokenizer = target_from_args(args)
    prompts = synthesize_prompts(target, tokenizer, args.num_prompts, args.output, batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, categories=args.categories,
                                 exclude=exclude)
    logger.info("%d prompts in %s", len(prompts), args.output)


if __name__ == "__main__":
    main()
