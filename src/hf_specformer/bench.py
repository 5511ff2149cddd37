"""Side-by-side benchmark: plain `generate` against speculative generation, same prompts, same machine, one run.

Prompts are taken round-robin over the file's categories (MT-bench's file is sorted by category: its first 32 prompts
hold only 4 of its 8 categories), `num_prompts` of them; for each batch size B, the first max(B, min_rows) are cut
into batches of B (so B = 1 with 8 rows sees one prompt of each category); every batch is generated with plain
greedy `target.generate` and then with each proposer (interleaved batch by batch), and the outputs are compared row
by row. Reported per B and mode:
plain and speculative tokens/s (new tokens up to and including EOS, counted on the plain output),
speedup, kappa (tokens per row per target forward), acceptance per drafted position, and the cost-model limit
(k + 1) * t(B, 1) / t(B, k + 1) from timing one target forward of 1 and of k + 1 new tokens per row at that batch
size over a cache of the prompt plus half the continuation. The prompt's prefill forward is the same work with or
without speculation and the cost model leaves it out, so it is timed separately and the decode phase is compared
too: decode speedup = (plain - prefill) / (speculative - prefill), and engine efficiency = decode speedup / limit. The
oracle proposer drafts the target's own greedy continuation (all drafts accepted), so its efficiency measures the
engine apart from drafter quality. A drafter can also be measured with prompt lookup on top (mode `DIR+lookup`,
`generate(..., lookup_ngram_size=4)`; the plain drafter mode runs with lookup off); the oracle never uses it.
Every drafter mode runs under each schedule asked for (`--schedules`): `fixed` (every row verifies k drafts),
`goodput` (the goodput scheduler on the drafter's own confidence, packed steps), `padded` (the same over padded
steps of one width, `packed_verification=False`) and, with `--companion DIR`, `companion` (the goodput scheduler on
Speculative Verification's (S, A) from the companion); `alternative` and `alternative-3` are `goodput` with
`alternative_draft=1` or `3` (slot 1's second-best token, then the drafts after it, verified as a branch of their
own, `generation/alternatives.py`), `alternatives-2x3` and `alternatives-3x3` with two or three such branches of 3
(slot 1's 2nd and 3rd, or 2nd to 4th, tokens). `goodput` runs as `generate` does by default: from the step
costs cached on this machine, if any, else learnt from its own steps (the first call at a batch size pays for that,
as a user's would). `costs-x0.5`, `costs-x2` and `plain-x2` give the goodput scheduler a profile measured before
any timing (`measure_step_costs`) and deliberately made wrong: every cost halved, doubled, or only the plain step's
doubled (so the engine looks better than it is everywhere); the online feedback must recover. `fixed` gets the
same profile unscaled, which it does not choose by, so its rows compare each step's measured seconds with the
profile's (`predicted_seconds_per_step_by_width`). Rows report the drafts verified per step, the mean width chosen,
the share of inputs fed that were padding (computed as zeros by packed steps), seconds per step by width beside
plain `generate`'s seconds per decoding step, and host reads per step.

Every row that differs from plain decoding is classified (`ties.py`): a tie where the target's two candidates are
within rounding of each other in the dtype it runs in (expected in bfloat16/float16), or a true bug. Rows report
`tie_rows`, `true_bug_rows`, `tie_rate` and each mismatch. `--device` and `--dtype` put the target (and drafters)
on a GPU or in low precision; timings synchronise the device.

Writes `<output>.json` and `<output>.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from .generation import OracleProposer, SpecFormerProposer, generate
from .generation.costs import profile_batch_sizes
from .bench_measures import ModeTally, chat_batches, count_new_tokens, forward_cost_limit, prefill_seconds
from .generation.forwards import LoopLayers
from .generation.linears import few_row_products
from .generation.profiling import measure_step_costs
from .generation.scheduling import CONFIDENCE_THRESHOLD
from .generation.speculation import LOOKUP_NGRAM_SIZE
from .hub.cards import LOOKUP_SUFFIX
from .models import SpecFormerConfig, SpecFormerForDrafting
from .prompts import find_shared_data, load_prompts
from .targets import (DEFAULT_TARGET, DTYPES, default_device, describe_machine, load_target, load_tokenizer,
                      timed)

BENCH_PROMPTS = "spec_bench_mtbench.jsonl"


@dataclass
class BenchConfig:
    """What to measure. `modes` holds `oracle`, `untrained` and/or a drafter folder path, each of the last two
    optionally with `LOOKUP_SUFFIX` (prompt lookup on top)."""

    target: str = DEFAULT_TARGET
    modes: list[str] = field(default_factory=lambda: ["oracle"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32])
    num_draft_tokens: int = 4
    max_new_tokens: int = 128
    num_prompts: int = 32
    min_rows: int = 8
    prompts: str | None = None
    threads: int = 2
    device: str | None = None
    dtype: str = "float32"
    limit_repeats: int = 15
    compaction_hole_fraction: float = 0.5
    confidence_threshold: float = CONFIDENCE_THRESHOLD
    schedules: list[str] = field(default_factory=lambda: ["fixed"])
    companion: str | None = None
    few_row_plain: bool = False
    rounds: int = 1
    output: str = "bench/results"


def split_mode(mode: str) -> tuple[str, int]:
    """A mode -> (the proposer's mode, the prompt-lookup n-gram size it runs with; 0: off)."""
    if mode.endswith(LOOKUP_SUFFIX):
        return mode.removesuffix(LOOKUP_SUFFIX), LOOKUP_NGRAM_SIZE
    return mode, 0


SCHEDULE_KWARGS = {"fixed": {"schedule": "fixed"}, "goodput": {"schedule": "goodput"},
                   "padded": {"schedule": "goodput", "packed_verification": False},
                   "companion": {"schedule": "goodput"},
                   "costs-x0.5": {"schedule": "goodput"}, "costs-x2": {"schedule": "goodput"},
                   "plain-x2": {"schedule": "goodput"},
                   "alternative": {"schedule": "goodput", "alternative_draft": 1},
                   "alternative-3": {"schedule": "goodput", "alternative_draft": 3},
                   "alternatives-2x3": {"schedule": "goodput", "alternative_draft": 3, "num_alternatives": 2},
                   "alternatives-3x3": {"schedule": "goodput", "alternative_draft": 3, "num_alternatives": 3}}
"""Bench schedule -> `generate` arguments (`companion` adds the companion model, the `WRONG_COSTS` schedules a
deliberately wrong profile)."""

WRONG_COSTS = {"costs-x0.5": (0.5, 0.5), "costs-x2": (2.0, 2.0), "plain-x2": (1.0, 2.0)}
"""Schedule -> (factor on every cost, factor on the plain step's) of the measured profile it is given."""


def run_label(mode: str, schedule: str) -> str:
    """The name of one (mode, schedule) run in reports and plots: the oracle has no schedule."""
    return mode if mode == "oracle" else f"{mode} [{schedule}]"


def runs(config: BenchConfig) -> list[tuple[str, str]]:
    """(mode, schedule) pairs measured: the oracle once (fixed k), every other mode under every schedule."""
    return [(mode, "fixed") if mode == "oracle" else (mode, schedule)
            for mode in config.modes for schedule in (["fixed"] if mode == "oracle" else config.schedules)]


def make_assistant(mode: str, target, reference_new: torch.LongTensor, k: int, pad_token_id: int):
    """The proposer for a mode: the oracle, a freshly initialised SpecFormer, or a drafter folder."""
    if mode == "oracle":
        return OracleProposer(reference_new, k, target.config.vocab_size, pad_token_id)
    if mode == "untrained":
        torch.manual_seed(0)
        drafter = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config))
        return drafter.to(target.device, target.dtype).eval()
    return AutoModel.from_pretrained(mode, trust_remote_code=True, dtype=target.dtype).to(target.device).eval()


def _speculative_run(target, tokenizer, batch, reference, run: tuple[str, str], config: BenchConfig,
                     drafters: dict, gen_kwargs):
    """One (mode, schedule) on one batch -> (output, seconds)."""
    mode, schedule = run
    proposer_mode, lookup_ngram_size = split_mode(mode)
    assistant = drafters.get(proposer_mode) or make_assistant(
        proposer_mode, target, reference[:, batch["input_ids"].shape[1]:], config.num_draft_tokens,
        tokenizer.pad_token_id,
    )
    speculation = dict(SCHEDULE_KWARGS[schedule])
    if schedule == "fixed":
        speculation["confidence_threshold"] = config.confidence_threshold
        if "profile" in drafters:  # choices ignore it; the statistics compare each step with its prediction
            speculation["step_costs"] = drafters["profile"]
    if schedule == "companion":
        speculation["companion_model"] = drafters["companion"]
    if schedule in WRONG_COSTS:
        speculation["step_costs"] = drafters["profile"].scaled(*WRONG_COSTS[schedule])
    return timed(lambda: generate(
        target, **batch, assistant_model=assistant, num_draft_tokens=config.num_draft_tokens,
        lookup_ngram_size=lookup_ngram_size, compaction_hole_fraction=config.compaction_hole_fraction,
        return_dict_in_generate=True, **speculation, **gen_kwargs,
    ), target.device)


def bench_batch_size(target, tokenizer, prompts, batch_size: int, config: BenchConfig, drafters: dict) -> list[dict]:
    """All modes at one batch size (over `max(batch_size, min_rows)` prompts); one row of results per mode.

    Runs are interleaved batch by batch (plain, then every mode, then the next batch), so a slow phase of a shared
    machine hits the baseline and each mode alike rather than whichever ran during it."""
    batches = [batch.to(target.device)
               for batch in chat_batches(tokenizer, prompts[: max(batch_size, config.min_rows)], batch_size)]
    gen_kwargs = dict(max_new_tokens=config.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    target.generate(**batches[0], **{**gen_kwargs, "max_new_tokens": 4})  # warm-up
    plain, prefill, few_row_plain, tokens, plain_steps = 0.0, 0.0, 0.0, 0, 0
    tallies = {run: ModeTally() for run in runs(config)}
    references = []
    for round_index in range(config.rounds):
        for index, batch in enumerate(tqdm(batches, desc=f"B={batch_size} round {round_index + 1}", leave=False)):
            def time_plain():
                nonlocal plain, prefill, tokens, plain_steps
                reference, seconds = timed(lambda: target.generate(**batch, **gen_kwargs), target.device)
                plain += seconds
                plain_steps += reference.shape[1] - batch["input_ids"].shape[1] - 1  # the prefill made the first
                prefill += prefill_seconds(target, batch)
                tokens += count_new_tokens(reference, batch["input_ids"].shape[1], tokenizer.eos_token_id)
                if round_index == 0:
                    references.append(reference)

            order = list(tallies.items())
            if round_index % 2 == 0:
                time_plain()
            else:  # odd rounds run the modes in reverse order, then plain: no run always follows the same one
                order.reverse()
            if config.few_row_plain:
                with few_row_products([target], head=target.get_output_embeddings()):
                    few_row_plain += timed(lambda: target.generate(**batch, **gen_kwargs), target.device)[1]
            for run, tally in order:
                tally.add(*_speculative_run(target, tokenizer, batch, references[index], run, config, drafters,
                                            gen_kwargs), references[index], target, batch, tokenizer.pad_token_id)
            if round_index % 2 == 1:
                time_plain()
    first_reference = references[0]
    width = batches[0]["input_ids"].shape[1]
    context = first_reference[:, : width + config.max_new_tokens // 2]  # prompt + half the plain continuation
    context_mask = torch.cat([batches[0]["attention_mask"], torch.ones_like(context[:, width:])], 1)
    limit = forward_cost_limit(target, context, context_mask, config.num_draft_tokens, config.limit_repeats)
    rows = []
    for (mode, schedule), tally in tallies.items():
        decode_speedup = (plain - prefill) / (tally.seconds - prefill)
        rows.append({
            "mode": mode, "schedule": schedule, "label": run_label(mode, schedule), "batch_size": batch_size,
            "num_batches": len(batches), "rounds": config.rounds, "new_tokens": tokens,
            "plain_seconds": plain, "spec_seconds": tally.seconds, "prefill_seconds": prefill,
            "plain_seconds_per_step": (plain - prefill) / max(plain_steps, 1),
            "plain_tokens_per_s": tokens / plain, "spec_tokens_per_s": tokens / tally.seconds,
            "speedup": plain / tally.seconds, "decode_speedup": decode_speedup, **limit,
            "efficiency": decode_speedup / limit["limit"],
            "tokens_per_step": statistics.mean(tally.kappas),
            "drafts_per_step": statistics.mean(tally.drafts_per_step),
            "acceptance_by_position": [statistics.mean(col) for col in zip(*tally.per_position)],
            "mismatched_rows": tally.mismatched_rows, "rows": len(batches) * batch_size * config.rounds,
            "tie_rate": sum(m["tie"] for m in tally.mismatches) / (len(batches) * batch_size * config.rounds),
            **tally.summary(),
        })
        if config.few_row_plain:
            rows[-1].update(few_row_plain_seconds=few_row_plain,
                            speedup_over_few_row_plain=few_row_plain / tally.seconds)
    return rows


def measure_profile(target, config: BenchConfig, drafters: dict) -> None:
    """With a `WRONG_COSTS` or the fixed schedule, measures the step costs up to the largest batch size (before any
    timing), for those schedules to distort, and for the fixed schedule's steps to be compared with; stored as
    `drafters["profile"]`."""
    if not set(config.schedules) & {*WRONG_COSTS, "fixed"}:
        return
    mode = next((split_mode(mode)[0] for mode in config.modes if split_mode(mode)[0] != "oracle"), None)
    if mode is None:  # the oracle drafts for free: nothing to profile
        if set(config.schedules) & set(WRONG_COSTS):
            raise SystemExit(f"The schedules {sorted(WRONG_COSTS)} need a drafter (--drafter DIR or --untrained).")
        return
    drafter = drafters[mode]
    if not drafter.is_bound:
        drafter.bind_target(target)
    proposer = SpecFormerProposer(drafter, config.num_draft_tokens)
    layers = LoopLayers(target, [target, *proposer.modules()])
    drafters["profile"] = measure_step_costs(target, proposer, layers,
                                             profile_batch_sizes(max(config.batch_sizes)), config.num_draft_tokens)


def plot(results: list[dict], path: Path) -> None:
    """Speedup per batch size for each mode, with the cost-model limit."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("The benchmark's plot needs matplotlib: pip install 'hf-specformer[plot]'.") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(row["label"] for row in results))
    for label in labels:
        rows = [row for row in results if row["label"] == label]
        sizes = [r["batch_size"] for r in rows]
        name = label.replace(str(Path(rows[0]["mode"]).parent) + "/", "") if "/" in label else label
        axis.plot(sizes, [r["speedup"] for r in rows], marker="o", label=name)
    limit_rows = [row for row in results if row["label"] == labels[0]]
    axis.plot([r["batch_size"] for r in limit_rows], [r["limit"] for r in limit_rows], "k--", label="cost-model limit")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size")
    axis.set_ylabel("speedup over plain generate (end to end)")
    axis.set_title("Speculative vs plain greedy generate")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_benchmark(config: BenchConfig) -> dict:
    """Runs every batch size and mode; writes `<output>.json` and `<output>.png`; returns the report."""
    torch.set_num_threads(config.threads)
    device = torch.device(config.device or default_device())
    target = load_target(config.target, dtype=DTYPES[config.dtype], device=device)
    tokenizer = load_tokenizer(config.target)
    source = config.prompts or find_shared_data(BENCH_PROMPTS)
    prompts = load_prompts(source, interleave_field="category", limit=config.num_prompts)
    if len(prompts) < max(config.batch_sizes):
        origin = source or "the built-in prompt set"
        raise SystemExit(f"The largest batch size, {max(config.batch_sizes)}, needs as many prompts; {origin} gave "
                         f"{len(prompts)} (pass --prompts FILE or a larger --num-prompts).")
    proposer_modes = {split_mode(mode)[0] for mode in config.modes}
    drafters = {
        mode: make_assistant(mode, target, None, config.num_draft_tokens, tokenizer.pad_token_id)
        for mode in proposer_modes if mode != "oracle"
    }
    if "companion" in config.schedules:
        if not config.companion:
            raise SystemExit("The companion schedule needs --companion DIR.")
        drafters["companion"] = AutoModel.from_pretrained(config.companion, trust_remote_code=True,
                                                          dtype=target.dtype).to(device).eval()
    measure_profile(target, config, drafters)
    results = []
    for batch_size in tqdm(config.batch_sizes, desc="batch sizes"):
        results.extend(bench_batch_size(target, tokenizer, prompts, batch_size, config, drafters))
        for row in results[-len(runs(config)):]:
            tqdm.write(f"B={batch_size} {row['label']}: {row['speedup']:.2f}x, kappa {row['tokens_per_step']:.2f}, "
                       f"{row['drafts_per_step']:.2f} drafts/step, mismatched {row['mismatched_rows']} "
                       f"({row['tie_rows']} ties, {row['true_bug_rows']} true bugs)")
    report = {
        "config": asdict(config),
        "prompt_source": source or "hf_specformer default prompts",
        "machine": describe_machine(device, config.dtype),
        "results": results,
    }
    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(results, output.with_suffix(".png"))
    return report


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="hf-specformer bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--oracle", action="store_true", help="measure the engine ceiling with an oracle drafter")
    parser.add_argument("--untrained", action="store_true", help="a freshly initialised SpecFormer")
    parser.add_argument("--drafter", action="append", default=[], help="a drafter folder (repeatable)")
    parser.add_argument("--lookup", choices=["off", "on", "both"], default="both",
                        help="drafters (and --untrained) without prompt lookup, with it (mode DIR+lookup), or both")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts loaded (at least the largest batch)")
    parser.add_argument("--min-rows", type=int, default=8, help="rows generated per batch size, at least B")
    parser.add_argument("--prompts", default=None, help="prompt file; default: shared MT-bench set, else built-in")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and drafter dtype")
    parser.add_argument("--compaction-hole-fraction", type=float, default=0.5,
                        help="compact caches at this hole share (above 1: never), to measure compaction")
    parser.add_argument("--confidence-threshold", type=float, default=CONFIDENCE_THRESHOLD,
                        help="with the fixed schedule, rows verify drafts while their cumulative probability is at "
                        "least this (0: all k)")
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULE_KWARGS), default=["fixed", "goodput"],
                        help="schedules each drafter mode runs under (companion: goodput with --companion)")
    parser.add_argument("--companion", default=None, help="a companion folder (schedule `companion`)")
    parser.add_argument("--few-row-plain", action="store_true",
                        help="also time plain generate with the engine's few-row CPU products (a second baseline)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every batch this many times, the order of plain and the modes reversed in every "
                        "second round (for sizes with few batches, whose single runs follow the machine's noise)")
    parser.add_argument("--output", default="bench/results", help="path stem of the JSON and PNG")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    drafters = (["untrained"] if args.untrained else []) + args.drafter
    suffixes = {"off": [""], "on": [LOOKUP_SUFFIX], "both": ["", LOOKUP_SUFFIX]}[args.lookup]
    modes = (["oracle"] if args.oracle else []) + [mode + suffix for mode in drafters for suffix in suffixes]
    if not modes:
        raise SystemExit("Choose at least one of --oracle, --untrained, --drafter DIR.")
    return BenchConfig(
        target=args.target, modes=modes, batch_sizes=args.batch_sizes, num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts, min_rows=args.min_rows, prompts=args.prompts,
        threads=args.threads, device=args.device, dtype=args.dtype, output=args.output,
        compaction_hole_fraction=args.compaction_hole_fraction,
        few_row_plain=args.few_row_plain, confidence_threshold=args.confidence_threshold, rounds=args.rounds,
        schedules=args.schedules + (["companion"] if args.companion and "companion" not in args.schedules else []),
        companion=args.companion,
    )


def main(argv: list[str] | None = None) -> dict:
    return run_benchmark(config_from_args(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
