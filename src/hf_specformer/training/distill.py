"""Self-distillation data: the target answers a prompt set itself (greedy decoding), and we keep its answers.

A drafter trained on these answers learns the target's own distribution, which is what speculative decoding
rewards. Generation is slow on a CPU, so it is resumable: every finished batch is appended to
`<output>/progress/records.jsonl` (flushed and fsynced) and a restart skips the prompts already answered.
When every prompt is done, the records become a `datasets.Dataset` saved to `<output>/dataset`.

Run it with `hf-specformer distill ...` or `python -m hf_specformer.training.distill ...`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch
from datasets import Dataset, Features, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_specformer.targets import DEFAULT_TARGET, DTYPES, default_device, load_target, load_tokenizer
from hf_specformer.training.data import chat_prompt_ids, load_prompts

logger = logging.getLogger(__name__)

PROGRESS_DIR = "progress"
RECORDS_FILE = "records.jsonl"
META_FILE = "meta.json"
DATASET_DIR = "dataset"
# Prompts are sorted by length within windows of this many batches, not globally: padding stays small, while
# the part done so far (and the progress bar's rate) stays representative of the whole set.
SORT_WINDOW_BATCHES = 32
FEATURES = Features(
    {
        "id": Value("int64"),
        "prompt": Value("string"),
        "input_ids": List(Value("int32")),
        "prompt_length": Value("int32"),
        "response": Value("string"),
    }
)


def target_fingerprint(target: PreTrainedModel) -> dict:
    """What identifies a target across runs: its name, sizes and a hash of its whole configuration."""
    config = {k: v for k, v in target.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    config_json = json.dumps(config, sort_keys=True, default=str)
    return {
        "target": target.config.name_or_path,
        "vocab_size": target.config.vocab_size,
        "hidden_size": target.config.hidden_size,
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
    }


def run_meta(target: PreTrainedModel, prompts: list[str], max_new_tokens: int) -> dict:
    """What a resumed run must share with the one that wrote the progress: target, prompts, answer length."""
    return {
        **target_fingerprint(target),
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }


def check_or_write_meta(path: str, meta: dict) -> None:
    """Writes `meta` to `path` for a new run; for a resumed one, raises ValueError if `meta` differs from it."""
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        changed = sorted(key for key in meta.keys() | saved.keys() if saved.get(key) != meta.get(key))
        if changed:
            raise ValueError(
                f"{path} describes a different run (differs in {changed}); use another output or delete it"
            )
        return
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(temporary, path)


def read_records(path: str) -> dict[int, dict]:
    """Records saved so far, by id. A last line without newline (a write cut by a kill) is dropped from the file."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    lines = complete.decode().split("\n")  # not splitlines(): prompts may hold U+2028 and other line breaks
    records = (json.loads(line) for line in lines if line)
    return {record["id"]: record for record in records}


def append_records(path: str, records: list[dict]) -> None:
    """Appends `records` as JSON lines in one write, then flushes and fsyncs so a kill loses nothing written."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        f.flush()
        os.fsync(f.fileno())


def plan_batches(todo: list[tuple[int, list[int]]], batch_size: int) -> Iterator[list[tuple[int, list[int]]]]:
    """Batches of `(id, prompt ids)`, sorted by prompt length within windows of `SORT_WINDOW_BATCHES` batches."""
    window = batch_size * SORT_WINDOW_BATCHES
    for start in range(0, len(todo), window):
        chunk = sorted(todo[start : start + window], key=lambda item: len(item[1]))
        for batch_start in range(0, len(chunk), batch_size):
            yield chunk[batch_start : batch_start + batch_size]


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` for `sequences`, padded on the left to the longest one."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, width - len(sequence) :] = 1
    return input_ids, attention_mask


def eos_token_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end an answer: the target's generation config's, else the tokenizer's EOS."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


def cut_after_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them if there is none)."""
    end = next((position + 1 for position, token in enumerate(tokens) if token in eos_ids), len(tokens))
    return tokens[:end]


@torch.inference_mode()
def answer_batch(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: list[tuple[int, list[int]]],
    max_new_tokens: int,
) -> list[tuple[int, list[int], list[int]]]:
    """Greedy answers of the target to a batch of `(id, prompt ids)`, as `(id, prompt ids, answer ids)`."""
    input_ids, attention_mask = left_pad([ids for _, ids in batch], tokenizer.pad_token_id)
    output = target.generate(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    eos_ids = eos_token_ids(target, tokenizer)
    answers = output[:, input_ids.shape[1] :].tolist()
    return [(index, ids, cut_after_eos(answer, eos_ids)) for (index, ids), answer in zip(batch, answers)]


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


def save_dataset(records: list[dict], output_dir: str) -> Dataset:
    """The records, sorted by id, as a Dataset saved to `<output_dir>/dataset` (replacing any earlier one whole)."""
    dataset = Dataset.from_list(sorted(records, key=lambda record: record["id"]), features=FEATURES)
    final = os.path.join(output_dir, DATASET_DIR)
    temporary = tempfile.mkdtemp(prefix=".dataset-", dir=output_dir)
    dataset.save_to_disk(temporary)
    if os.path.exists(final):
        stale = tempfile.mkdtemp(prefix=".dataset-old-", dir=output_dir)
        os.replace(final, os.path.join(stale, DATASET_DIR))
        os.replace(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)
    return dataset


def distill(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    output_dir: str,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_prompt_tokens: int = 512,
    progress: bool = True,
) -> Dataset:
    """Has `target` answer every prompt greedily and returns the records (see `make_record`) as a Dataset.

    Resumes from `<output_dir>/progress` if it holds a run with the same target, prompts and `max_new_tokens`
    (ValueError if it holds another). Prompts longer than `max_prompt_tokens` tokens are skipped and counted.
    The dataset, sorted by id, is also saved to `<output_dir>/dataset`.
    """
    progress_dir = os.path.join(output_dir, PROGRESS_DIR)
    os.makedirs(progress_dir, exist_ok=True)
    for leftover in glob.glob(os.path.join(output_dir, ".dataset-*")):  # of a run killed while saving the dataset
        shutil.rmtree(leftover, ignore_errors=True)
    check_or_write_meta(os.path.join(progress_dir, META_FILE), run_meta(target, prompts, max_new_tokens))
    records_path = os.path.join(progress_dir, RECORDS_FILE)
    done = read_records(records_path)
    prompt_ids = {i: chat_prompt_ids(tokenizer, prompt) for i, prompt in enumerate(prompts) if i not in done}
    todo = [(index, ids) for index, ids in prompt_ids.items() if len(ids) <= max_prompt_tokens]
    skipped = len(prompt_ids) - len(todo)
    logger.info(
        "%d prompts: %d done before, %d to answer, %d skipped (over %d tokens)",
        len(prompts), len(done), len(todo), skipped, max_prompt_tokens,
    )

    bar = tqdm(total=len(prompts), initial=len(done) + skipped, unit="prompt", disable=not progress, desc="distill")
    generated, start = 0, time.perf_counter()
    for batch in plan_batches(todo, batch_size):
        answers = answer_batch(target, tokenizer, batch, max_new_tokens)
        new = [make_record(index, prompts[index], ids, answer, tokenizer) for index, ids, answer in answers]
        append_records(records_path, new)
        done.update((record["id"], record) for record in new)
        generated += sum(len(answer) for _, _, answer in answers)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}", skipped=skipped)
    bar.close()
    return save_dataset(list(done.values()), output_dir)


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """`--target`, `--device`, `--dtype` and `--threads`: which target generates, and where."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    parser.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="target dtype (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def target_from_args(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target and its tokenizer as `add_target_arguments` asked, after setting the CPU threads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=DTYPES[args.dtype], device=args.device or default_device())
    return target, load_tokenizer(args.target)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of `hf-specformer distill`."""
    parser = argparse.ArgumentParser(prog="hf-specformer distill", description=__doc__.split("\n\n")[0])
    add_target_arguments(parser)
    parser.add_argument("--prompts", action="append", default=None,
                        help="local .jsonl/.json/.parquet file or Hub dataset; repeat to concatenate several "
                        "(default: the small prompt set shipped in the package)")
    parser.add_argument("--prompt-field", default=None, help="column holding the prompts (default: detected)")
    parser.add_argument("--split", default="train", help="dataset split (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts after shuffling")
    parser.add_argument("--output", required=True, help="output folder (progress/ and dataset/ go there)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="skip longer prompts (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `hf-specformer distill`: loads prompts and target, then runs `distill`."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    prompts = load_prompts(
        args.prompts, prompt_field=args.prompt_field, split=args.split, limit=args.limit, shuffle_seed=args.seed
    )
    target, tokenizer = target_from_args(args)
    dataset = distill(
        target,
        tokenizer,
        prompts,
        args.output,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    logger.info("saved %d records to %s", len(dataset), os.path.join(args.output, DATASET_DIR))


if __name__ == "__main__":
    main()
