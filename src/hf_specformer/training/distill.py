"""Self-distillation data (`hf-specformer distill`): the target answers a prompt set greedily, resumable and sharded
as the batch job (`data.answering`); a drafter trained on the answers learns the target's own distribution."""

from __future__ import annotations

import argparse
import logging
import os

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_specformer.data.answering import (GenerationSettings, add_length_arguments, add_prompt_arguments,
                                          generate_dataset, process_state)
from hf_specformer.data.prompts import load_prompts
from hf_specformer.data.records import DATASET_DIR


def distill(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], output_dir: str, *,
            max_new_tokens: int = 256, batch_size: int = 16, max_prompt_tokens: int = 512,
            drafter: PreTrainedModel | None = None, progress: bool = True) -> Dataset | None:
    """`generate_dataset` with distillation's settings (greedy, chat template); a `drafter` only makes it faster."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  max_prompt_tokens=max_prompt_tokens)
    speculation = None if drafter is None else {"assistant_model": drafter}  # with prompt lookup, by default
    return generate_dataset(target, tokenizer, prompts, output_dir, settings, speculation=speculation,
                            progress=progress, description="distill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of `hf-specformer distill`."""
    from hf_specformer.targets import add_target_arguments

    parser = argparse.ArgumentParser(prog="hf-specformer distill", description=__doc__.split("\n\n")[0])
    add_target_arguments(parser)
    add_prompt_arguments(parser, "the small prompt set shipped in the package")
    add_length_arguments(parser)
    parser.add_argument("--drafter", default=None,
                        help="generate speculatively with this drafter folder ('shipped': the SmolLM2 drafter)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hf-specformer distill`: loads prompts and target, then runs `distill`."""
    from hf_specformer.targets import load_drafter
    from hf_specformer.targets import target_from_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prompts = load_prompts(args.prompts, prompt_field=args.prompt_field, split=args.split, limit=args.limit,
                           shuffle_seed=args.seed, exclude_overlap=args.exclude_overlap)
    target, tokenizer = target_from_args(args, process_state().device)
    drafter = None if args.drafter is None else load_drafter(None if args.drafter == "shipped" else args.drafter,
                                                             target)
    dataset = distill(target, tokenizer, prompts, args.output, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens, drafter=drafter)
    if dataset is not None:
        tokens = sum(len(ids) - length for ids, length in zip(dataset["input_ids"], dataset["prompt_length"]))
        print(f"wrote {os.path.join(args.output, DATASET_DIR)}: {len(dataset)} answers of {args.target}, "
              f"{tokens} reply tokens (up to {args.max_new_tokens} each)")


if __name__ == "__main__":
    main()
