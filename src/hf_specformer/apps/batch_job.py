"""Offline batch generation: a target answers a whole prompt set, speculatively by default, resumable and sharded.

    hf-specformer generate --prompts questions.jsonl --output answers/           # SmolLM2 + the shipped drafter
    accelerate launch -m hf_specformer.apps.batch_job --prompts ... --output answers/   # one shard per process

Prompts from any `datasets` source, in the chat template, answered with the drafter (or `--plain`) on continuous
batching (`--static`: static batches); each answer is saved as it finishes, so a restart skips what is done. The
result: `<output>/dataset` and `generations.jsonl` (`data/answering.py`).
"""

from __future__ import annotations

import argparse
import logging
import os

from transformers import PreTrainedModel

from ..data.answering import GenerationSettings, add_length_arguments, add_prompt_arguments, generate_dataset, \
    process_state
from ..data.records import DATASET_DIR, GENERATIONS_FILE
from ..generation import SpeculationConfig, SuffixIndex
from ..generation.suffix import MAX_INDEX_TOKENS

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of `hf-specformer generate`."""
    from ..targets import add_target_arguments

    parser = argparse.ArgumentParser(prog="hf-specformer generate", description=__doc__.split("\n\n")[0])
    add_target_arguments(parser)
    add_prompt_arguments(parser, "the small prompt set shipped in the package")
    add_length_arguments(parser)
    parser.add_argument("--shuffle", action="store_true", help="shuffle the prompts (with --seed) before --limit")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="feed the prompts as raw text instead of user messages")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    speculation = parser.add_argument_group("speculation")
    speculation.add_argument("--plain", action="store_true", help="plain decoding, no speculation")
    speculation.add_argument("--static", action="store_true",
                             help="static batches of --batch-size prompts instead of continuous batching")
    speculation.add_argument("--memory-budget-gib", type=float, default=None,
                             help="continuous batching: fewer slots than --batch-size where their caches and logits "
                                  "would not fit in this many GiB")
    speculation.add_argument("--drafter", default=None,
                             help="SpecFormer drafter folder (default: the shipped one, for the default target)")
    speculation.add_argument("--companion", default=None, help="Speculative Verification companion folder")
    speculation.add_argument("--num-draft-tokens", "-k", type=int, default=None, help="default: the drafter's")
    speculation.add_argument("--lookup-ngram-size", type=int, default=SpeculationConfig.lookup_ngram_size,
                             help="prompt lookup on top of the drafter, longest n-gram (0: off; default %(default)s)")
    speculation.add_argument("--schedule", choices=["goodput", "fixed"], default="goodput")
    speculation.add_argument("--suffix-index-tokens", type=int, default=0,
                             help="cross-request suffix drafts from the prompts and answers this process has seen, "
                             "keeping at most this many tokens (0: off; e.g. 65536)")
    speculation.add_argument("--suffix-corpus", default=None,
                             help="a distilled data folder (`hf-specformer distill` output) whose replies seed the "
                                  "suffix index (turns suffix drafts on; kept on top of --suffix-index-tokens)")
    return parser


def seeded_suffix_index(corpus: str | os.PathLike | None = None,
                        max_tokens: int = MAX_INDEX_TOKENS) -> SuffixIndex:
    """A `SuffixIndex` of `max_tokens` generated tokens, seeded with the replies of the distilled data `corpus` (the
    target's past answers, as SuffixDecoding's global tree; the oldest, so the first to go)."""
    from ..training.data import load_distilled, reply_sequences

    replies = [] if corpus is None else reply_sequences(load_distilled(corpus))
    index = SuffixIndex(max_tokens + sum(reply.numel() for reply in replies))
    index.add(replies)
    return index


def speculation_from_args(args: argparse.Namespace, target: PreTrainedModel) -> dict | None:
    """The speculative arguments of `generate` that the options ask for (None for `--plain`)."""
    from ..targets import load_companion, load_drafter

    if args.plain:
        return None
    config = {"num_draft_tokens": args.num_draft_tokens, "lookup_ngram_size": args.lookup_ngram_size,
              "schedule": args.schedule}
    if args.suffix_index_tokens or args.suffix_corpus:  # one index per process, for every batch
        config["suffix_index"] = seeded_suffix_index(args.suffix_corpus, args.suffix_index_tokens or MAX_INDEX_TOKENS)
    speculation = {"assistant_model": load_drafter(args.drafter, target), "speculation_config": config}
    if args.companion:
        speculation["companion_model"] = load_companion(args.companion, target)
    return speculation


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hf-specformer generate` and `accelerate launch -m hf_specformer.apps.batch_job`."""
    from ..data.prompts import load_prompts
    from ..targets import DEFAULT_TARGET, target_from_args

    args = build_parser().parse_args(argv)
    if not args.plain and args.drafter is None and args.target != DEFAULT_TARGET:
        raise SystemExit(f"No drafter is shipped for {args.target}: pass --drafter DIR (trained with "
                         "`hf-specformer train`), or --plain.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                  batch_size=args.batch_size, do_sample=args.do_sample, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed, chat_template=args.chat_template,
                                  continuous=not args.static, memory_budget_gib=args.memory_budget_gib)
    prompts = load_prompts(args.prompts, prompt_field=args.prompt_field, split=args.split, limit=args.limit,
                           shuffle_seed=args.seed if args.shuffle else None, exclude_overlap=args.exclude_overlap)
    target, tokenizer = target_from_args(args, process_state().device)
    dataset = generate_dataset(target, tokenizer, prompts, args.output, settings,
                               speculation=speculation_from_args(args, target))
    if dataset is not None:
        logger.info("%d answers in %s and %s", len(dataset), os.path.join(args.output, DATASET_DIR),
                    os.path.join(args.output, GENERATIONS_FILE))


if __name__ == "__main__":
    main()
