"""Offline batch generation: a target answers a whole prompt set, speculatively by default, resumable and sharded.

    hf-specformer generate --prompts questions.jsonl --output answers/           # SmolLM2 + the shipped drafter
    accelerate launch -m hf_specformer.batch_generation --prompts ... --output answers/   # one shard per process

Prompts come from any `datasets` source (`--prompts` repeated: local .jsonl/.json/.parquet files or Hub dataset
names; the prompt column is detected). Each prompt is wrapped in the target's chat template (`--no-chat-template`
for raw text) and answered by `hf_specformer.generate` with a drafter (plus prompt lookup, the goodput scheduler and,
with `--suffix-index-tokens`, suffix drafts from everything the process answered before), or by plain `generate`
with `--plain`; greedy by default, `--do-sample` for sampling. Speculation is
lossless, so the answers are the target's own (greedy: token for token, up to low-precision ties; sampling: the
same distribution).

Nothing is lost on interruption: every finished batch is appended to `<output>/progress/records*.jsonl` (see
`records.py`) and a restart skips what is done. Under `accelerate launch` process r of n answers every n-th
remaining prompt, on its own device, into its own records file. When every prompt is answered the main process
writes `<output>/dataset` (a `datasets` folder: `id`, `prompt`, `input_ids` = prompt + answer ids,
`prompt_length`, `response`) and `<output>/generations.jsonl` (`id`, `prompt`, `response`), ordered by id.

Choices: batches are sorted by length within windows (`batching.py`); prompts longer than `max_prompt_tokens` are
skipped and counted; a sampled batch is seeded from (seed, its first prompt's id), so an uninterrupted run repeats
exactly, and a resumed one draws fresh samples for the prompts left (from the same distribution).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from datasets import Dataset, Features, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .batching import (
    batch_seed,
    cut_after_eos,
    eos_token_ids,
    left_pad,
    plan_batches,
    prompt_ids,
)
from .generation import SuffixIndex, generate
from .generation.speculation import LOOKUP_NGRAM_SIZE
from .records import (
    DATASET_DIR,
    GENERATIONS_FILE,
    META_FILE,
    PROGRESS_DIR,
    THROUGHPUT_FILE,
    append_records,
    check_or_write_meta,
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


@dataclass
class GenerationSettings:
    """What is generated for each prompt. All of it but the batch size and the prompt limit must match when a run is
    resumed.

    Attributes:
        max_new_tokens: answer length cap.
        max_prompt_tokens: prompts longer than this (in tokens, template included) are skipped.
        batch_size: prompts per `generate` call (per process).
        do_sample, temperature, top_p: sampling (greedy when `do_sample` is False).
        seed: seed of the sampled batches.
        chat_template: wrap each prompt as a user message in the tokenizer's chat template.
    """

    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True

    def __post_init__(self):
        if min(self.max_new_tokens, self.max_prompt_tokens, self.batch_size) < 1:
            raise ValueError("max_new_tokens, max_prompt_tokens and batch_size must be at least 1.")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling needs temperature > 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}.")

    def generate_kwargs(self) -> dict:
        """The sampling arguments of `generate` (none for greedy decoding)."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}

    def meta(self) -> dict:
        """The settings a resumed run must share (the batch size and the prompt limit may change)."""
        return {name: value for name, value in asdict(self).items() if name not in ("batch_size", "max_prompt_tokens")}


def run_meta(target: PreTrainedModel, prompts: list[str], settings: GenerationSettings) -> dict:
    """What a resumed run must share with the one that wrote the progress: target, prompts and settings."""
    return {
        **target_fingerprint(target),
        **settings.meta(),
        "num_prompts": len(prompts),
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }


def process_state() -> PartialState:
    """This process's place under `accelerate launch` (the only process otherwise). Processes on CPUs need
    `PartialState`'s cpu flag, without which each would think it is alone: set where there is no GPU, or where
    ACCELERATE_USE_CPU asks for it."""
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())


@dataclass
class Throughput:
    """Running totals of one process: answer tokens, seconds, and (speculative) rows' steps and accepted drafts."""

    tokens: int = 0
    seconds: float = 0.0
    row_steps: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def kappa(self) -> float | None:
        """Committed tokens per row per target forward (1.0: plain decoding); None without speculation."""
        return (self.row_steps + self.accepted) / self.row_steps if self.row_steps else None

    def postfix(self) -> dict:
        kappa = {} if self.kappa is None else {"kappa": f"{self.kappa:.2f}"}
        return {"tok_s": f"{self.tokens_per_second:.1f}", **kappa}

    def save(self, path: str, **extra) -> None:
        """Writes the totals, tokens/s and kappa (and `extra`) as JSON."""
        with open(path, "w") as file:
            json.dump({**asdict(self), "tokens_per_second": self.tokens_per_second, "kappa": self.kappa, **extra},
                      file, indent=2)


@torch.inference_mode()
def answer_batch(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: list[tuple[int, list[int]]],
    settings: GenerationSettings,
    speculation: dict | None,
    throughput: Throughput,
) -> list[tuple[int, list[int], list[int]]]:
    """The target's answers to a batch of `(id, prompt ids)`, as `(id, prompt ids, answer ids)` cut after EOS.

    `speculation` holds the speculative arguments of `hf_specformer.generate` (`assistant_model`, ...); None runs
    plain `generate`. Adds the batch's tokens, time and acceptance to `throughput`.
    """
    input_ids, attention_mask = left_pad([ids for _, ids in batch], tokenizer.pad_token_id)
    kwargs = dict(input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                  max_new_tokens=settings.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  **settings.generate_kwargs())
    if settings.do_sample:
        torch.manual_seed(batch_seed(settings.seed, batch[0][0]))
    start = time.perf_counter()
    if speculation is None:
        sequences = target.generate(**kwargs)
    else:
        output = generate(target, **kwargs, **speculation, return_dict_in_generate=True)
        sequences, stats = output.sequences, output.speculation_stats
        throughput.row_steps += stats.row_steps
        throughput.accepted += stats.accepted
    eos_ids = eos_token_ids(target, tokenizer)
    answers = [cut_after_eos(answer, eos_ids) for answer in sequences[:, input_ids.shape[1] :].tolist()]
    throughput.seconds += time.perf_counter() - start
    throughput.tokens += sum(map(len, answers))
    return [(index, ids, answer) for (index, ids), answer in zip(batch, answers)]


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
    for batch in plan_batches(mine, settings.batch_size):
        answers = answer_batch(target, tokenizer, batch, settings, speculation, throughput)
        append_records(records_path, [make_record(index, prompts[index], ids, answer, tokenizer)
                                      for index, ids, answer in answers])
        bar.update(len(batch))
        bar.set_postfix(throughput.postfix(), refresh=False)
    bar.close()
    if mine:
        logger.info("process %d: %d answer tokens in %.1f s (%.1f tokens/s)%s", state.process_index,
                    throughput.tokens, throughput.seconds, throughput.tokens_per_second,
                    "" if throughput.kappa is None else f", kappa {throughput.kappa:.2f}")
        throughput.save(os.path.join(progress_dir, THROUGHPUT_FILE.format(state.process_index)),
                        num_prompts=len(mine), batch_size=settings.batch_size)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return save_outputs(list(read_all_records(progress_dir).values()), output_dir)


def add_prompt_arguments(parser: argparse.ArgumentParser, default_help: str) -> None:
    """`--prompts`, `--prompt-field`, `--split`, `--limit`, `--seed`: which prompts, in which order."""
    parser.add_argument("--prompts", action="append", default=None,
                        help=f"local .jsonl/.json/.parquet file or Hub dataset; repeat to concatenate several "
                        f"(default: {default_help})")
    parser.add_argument("--prompt-field", default=None, help="column holding the prompts (default: detected)")
    parser.add_argument("--split", default="train", help="dataset split (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts (after any shuffle)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle and of sampling "
                        "(default: %(default)s)")


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """`--output`, `--max-new-tokens`, `--max-prompt-tokens`, `--batch-size`."""
    parser.add_argument("--output", required=True, help="output folder (progress/, dataset/ ... go there)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="skip longer prompts (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="prompts per generate call and process (default: %(default)s)")


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
    speculation.add_argument("--plain", action="store_true", help="plain generate, no speculation")
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
    return parser


def speculation_from_args(args: argparse.Namespace, target: PreTrainedModel) -> dict | None:
    """The speculative arguments of `generate` that the options ask for (None for `--plain`)."""
    from .assistants import load_companion, load_drafter

    if args.plain:
        return None
    speculation = {"assistant_model": load_drafter(args.drafter, target), "num_draft_tokens": args.num_draft_tokens,
                   "lookup_ngram_size": args.lookup_ngram_size, "schedule": args.schedule}
    if args.companion:
        speculation["companion_model"] = load_companion(args.companion, target)
    if args.suffix_index_tokens:
        speculation["suffix_index"] = SuffixIndex(args.suffix_index_tokens)  # one per process, for every batch
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
        chat_template=args.chat_template,
    )
    prompts = load_prompts(args.prompts, prompt_field=args.prompt_field, split=args.split, limit=args.limit,
                           shuffle_seed=args.seed if args.shuffle else None)
    target, tokenizer = target_from_args(args, process_state().device)
    dataset = generate_dataset(target, tokenizer, prompts, args.output, settings,
                               speculation=speculation_from_args(args, target))
    if dataset is not None:
        logger.info("%d answers in %s and %s", len(dataset), os.path.join(args.output, DATASET_DIR),
                    os.path.join(args.output, GENERATIONS_FILE))


if __name__ == "__main__":
    main()
