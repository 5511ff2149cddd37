"""`hf-specformer eval-drafter`: a drafter's acceptance on the same texts, teacher-forced and live, per category.

    hf-specformer eval-drafter [--drafter DIR] [--target T] [--prompts F ...] [--with-lookup] [--with-suffix] --output E

Each prompt's plain greedy answer is scored teacher-forced and live (fixed k, lookup off, output checked): per-slot
acceptance and kappa per category; a gap between them above `MAX_GAP` is a bug. Writes `<output>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .batch_job import seeded_suffix_index
from ..data.batching import cut_after_eos, eos_token_ids
from ..generation import SuffixIndex, generate
from ..data.prompts import DEFAULT_PROMPTS_FILE, chat_prompt_ids, find_shared_data, labelled_prompts
from ..targets import (DEFAULT_TARGET, DTYPES, canonical_target, default_device, describe_machine, load_data_target,
                       load_drafter, load_target, load_tokenizer)
from ..training.evaluation import BEST_OF_LOOKUP, evaluate_kappa

MAX_GAP = 0.05
"""Largest |live - teacher-forced| slot acceptance on the same texts that is not a bug."""

MTBENCH_PROMPTS = "spec_bench_mtbench.jsonl"
ALL = "all"


@dataclass
class LiveTally:
    """Live decoding of one group: accepted drafts per slot, steps and committed tokens, rows unlike plain."""

    num_slots: int
    accepted_at: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    mismatched: int = 0

    def add(self, stats, identical: bool) -> None:
        self.accepted_at = [a + b for a, b in zip(self.accepted_at or [0] * self.num_slots, stats.accepted_at)]
        self.steps += stats.row_steps
        self.tokens += stats.accepted + stats.row_steps
        self.mismatched += not identical

    def report(self) -> dict:
        steps = max(self.steps, 1)
        return {"slot_acceptance": [count / steps for count in self.accepted_at or [0] * self.num_slots],
                "kappa": self.tokens / steps, "num_steps": self.steps, "mismatched_rows": self.mismatched}


def _live(target, drafter, input_ids: torch.LongTensor, k: int, max_new_tokens: int, lookup_ngram_size: int,
          suffix_index: SuffixIndex | None):
    return generate(target, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter,
                    max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                    speculation_config={"num_draft_tokens": k, "lookup_ngram_size": lookup_ngram_size,
                                        "suffix_index": suffix_index, "schedule": "fixed"})


LIVE_RUNS = {"live": "kappa live", "live_lookup": "kappa live + lookup", "live_suffix": "kappa live + lookup + suffix"}
"""Report key of each live run -> its table column."""


def _live_runs(with_lookup: bool, with_suffix: bool, lookup_ngram_size: int, suffix_corpus: str | None) -> dict:
    """The live runs asked for: report key -> (prompt lookup's n-gram size, suffix index)."""
    runs = {"live": (0, None)}
    if with_lookup:
        runs["live_lookup"] = (lookup_ngram_size, None)
    if with_suffix:
        runs["live_suffix"] = (lookup_ngram_size, seeded_suffix_index(suffix_corpus))
    return runs


@torch.no_grad()
def evaluate_drafter(target, drafter, prompts: list[list[int]], groups: list[str], num_draft_tokens: int,
                     max_new_tokens: int, eos_token_ids: set[int], with_lookup: bool = False,
                     with_suffix: bool = False, lookup_ngram_size: int = 4, suffix_corpus: str | None = None) -> dict:
    """Teacher-forced and live acceptance of `drafter` on the target's greedy answers to `prompts` (token ids), per
    group and over `"all"`: `{group: {"num_prompts", "teacher_forced": {...}, "live": {...}, "live_lookup": {...},
    "live_suffix": {...}, "gap"}}` (`gap`: the largest |live - teacher-forced| slot acceptance)."""
    k = num_draft_tokens
    texts: dict[str, list[dict]] = {}
    runs = _live_runs(with_lookup, with_suffix, lookup_ngram_size, suffix_corpus)
    tallies: dict[str, dict[str, LiveTally]] = {run: {} for run in runs}
    for prompt, group in zip(tqdm(prompts, desc="prompts"), groups):
        ids = torch.tensor([prompt], device=target.device)
        plain = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False)
        answer = cut_after_eos(plain[0, ids.shape[1]:].tolist(), eos_token_ids)
        for run, (ngram, suffix_index) in runs.items():
            output = _live(target, drafter, ids, k, max_new_tokens, ngram, suffix_index)
            identical = cut_after_eos(output.sequences[0, ids.shape[1]:].tolist(), eos_token_ids) == answer
            for name in (group, ALL):
                tallies[run].setdefault(name, LiveTally(k)).add(output.speculation_stats, identical)
        for name in (group, ALL):
            texts.setdefault(name, []).append({"input_ids": prompt + answer, "prompt_length": len(prompt)})
    bound_sizes = range(2, lookup_ngram_size + 1) if with_lookup or with_suffix else ()  # as the live runs match
    report = {}
    for name, rows in texts.items():
        forced = evaluate_kappa(target, drafter, rows, k, lookup_ngram_sizes=bound_sizes)
        row = {"num_prompts": len(rows), "teacher_forced": forced}
        row.update({run: tallies[run][name].report() for run in runs})
        row["gap"] = max(abs(a - b) for a, b in zip(row["live"]["slot_acceptance"], forced["slot_acceptance"]))
        report[name] = row
    return report


def table(report: dict) -> str:
    """The report as a Markdown table: slot acceptance and kappa, teacher-forced vs live, per group."""
    runs = [run for run in LIVE_RUNS if run in next(iter(report.values()))]
    bound = BEST_OF_LOOKUP in next(iter(report.values()))["teacher_forced"]
    header = "| group | prompts | slot acceptance, teacher-forced | live | kappa TF | " + \
        " | ".join(LIVE_RUNS[run] for run in runs) + (" | kappa TF, best of drafter and lookup" if bound else "") + \
        " | gap | rows unlike plain |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, row in sorted(report.items(), key=lambda item: (item[0] == ALL, item[0])):
        forced, live = row["teacher_forced"], row["live"]
        cells = [name, str(row["num_prompts"]), ", ".join(f"{a:.2f}" for a in forced["slot_acceptance"]),
                 ", ".join(f"{a:.2f}" for a in live["slot_acceptance"]), f"{forced['kappa'][-1]:.2f}"]
        cells += [f"{row[run]['kappa']:.2f}" for run in runs]
        cells += [f"{forced[BEST_OF_LOOKUP]:.2f}"] if bound else []
        cells += [f"{row['gap']:.3f}", str(sum(row[run]["mismatched_rows"] for run in runs))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def causes_table(report: dict) -> str:
    """Teacher-forced slot-1 accuracy per group beside what bounds it (draft-vocabulary coverage, the target's own
    confidence and the accuracy per bin of it): harder text told apart from what the drafter has not learnt."""
    bins = next(iter(report.values()))["teacher_forced"]["slot1_by_target_confidence"]
    header = ("| group | slot-1 accuracy | in draft vocabulary | target's confidence | " +
              " | ".join(f"accuracy where p in [{b['low']:.2f}, {b['high']:.2f}] (share)" for b in bins) + " |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, row in sorted(report.items(), key=lambda item: (item[0] == ALL, item[0])):
        forced = row["teacher_forced"]
        cells = [name, f"{forced['slot_accuracy'][0]:.3f}", f"{forced['draft_vocab_coverage']:.3f}",
                 f"{forced['mean_target_confidence']:.3f}"]
        cells += ["-" if b["accuracy"] is None else f"{b['accuracy']:.3f} ({b['share']:.2f})"
                  for b in forced["slot1_by_target_confidence"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Per group: slot-1 acceptance, teacher-forced beside live; kappa, teacher-forced beside every live run;
    teacher-forced slot-1 accuracy in each bin of the target's confidence (`causes_table`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(report, key=lambda name: (name == ALL, name))
    runs = [run for run in LIVE_RUNS if run in report[names[0]]]
    positions = torch.arange(len(names)).float()
    figure, axes = plt.subplots(3, 1, figsize=(max(8, (0.8 + 0.25 * len(runs)) * len(names)), 12))
    bins = report[names[0]]["teacher_forced"]["slot1_by_target_confidence"]
    panels = [
        ("slot-1 acceptance", {"teacher-forced": lambda r: r["teacher_forced"]["slot_acceptance"][0],
                               "live": lambda r: r["live"]["slot_acceptance"][0]}),
        ("kappa", {"teacher-forced": lambda r: r["teacher_forced"]["kappa"][-1],
                   **{LIVE_RUNS[run].removeprefix("kappa "): lambda r, run=run: r[run]["kappa"] for run in runs},
                   **({"teacher-forced, best of drafter and lookup": lambda r: r["teacher_forced"][BEST_OF_LOOKUP]}
                      if BEST_OF_LOOKUP in report[names[0]]["teacher_forced"] else {})}),
        ("teacher-forced slot-1 accuracy by the target's probability p of the label",
         {f"p in [{b['low']:.2f}, {b['high']:.2f}]":
          lambda r, i=i: r["teacher_forced"]["slot1_by_target_confidence"][i]["accuracy"] or 0.0
          for i, b in enumerate(bins)}),
    ]
    for axis, (title, bars) in zip(axes, panels):
        width = 0.8 / len(bars)
        for index, (label, value) in enumerate(bars.items()):
            offset = (index - (len(bars) - 1) / 2) * width
            axis.bar(positions + offset, [value(report[n]) for n in names], width, label=label)
        axis.set_xticks(positions.tolist(), names, rotation=45, ha="right")
        axis.set_title(title)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specformer eval-drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None,
                        help="target model (default: the --suffix-corpus data's, else smollm2)")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--prompts", action="append", default=None,
                        help="prompt file(s) (default: MT-bench from the shared data if present, and the package's)")
    parser.add_argument("--limit-per-group", type=int, default=None, help="at most this many prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--with-lookup", action="store_true", help="also a live run with prompt lookup")
    parser.add_argument("--with-suffix", action="store_true",
                        help="also a live run with prompt lookup and cross-request suffix drafts")
    parser.add_argument("--suffix-corpus", default=None,
                        help="with --with-suffix: a distilled data folder whose replies seed the suffix index (never "
                             "answers to the prompts evaluated)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="bench/drafter_eval", help="writes OUTPUT.json and OUTPUT.png")
    return parser


def select(prompts: list[str], groups: list[str], limit_per_group: int | None) -> tuple[list[str], list[str]]:
    """The first `limit_per_group` prompts of each group (all with None), in their order."""
    seen: dict[str, int] = {}
    kept = []
    for prompt, group in zip(prompts, groups):
        seen[group] = seen.get(group, 0) + 1
        if limit_per_group is None or seen[group] <= limit_per_group:
            kept.append((prompt, group))
    return [p for p, _ in kept], [g for _, g in kept]


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.num_draft_tokens < 1 or args.max_new_tokens < args.num_draft_tokens + 2:
        raise SystemExit("--num-draft-tokens must be at least 1 and --max-new-tokens at least k + 2.")
    if args.threads:
        torch.set_num_threads(args.threads)
    sources = args.prompts or [p for p in (find_shared_data(MTBENCH_PROMPTS), str(DEFAULT_PROMPTS_FILE)) if p]
    prompts, groups = select(*labelled_prompts(sources, "category"), args.limit_per_group)
    where = dict(dtype=DTYPES[args.dtype], device=default_device())
    target = (load_data_target(args.suffix_corpus, args.target, **where) if args.suffix_corpus
              else load_target(args.target or DEFAULT_TARGET, **where))
    tokenizer = load_tokenizer(canonical_target(target.config.name_or_path))
    drafter = load_drafter(args.drafter, target)
    if args.num_draft_tokens > drafter.config.draft_length:
        raise SystemExit(f"--num-draft-tokens exceeds the drafter's draft_length ({drafter.config.draft_length}).")
    report = evaluate_drafter(target, drafter, [chat_prompt_ids(tokenizer, prompt) for prompt in prompts], groups,
                              args.num_draft_tokens, args.max_new_tokens, eos_token_ids(target, tokenizer),
                              with_lookup=args.with_lookup, with_suffix=args.with_suffix,
                              suffix_corpus=args.suffix_corpus)
    print(table(report))
    print(causes_table(report))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({
        "config": vars(args), "sources": sources, "max_gap": MAX_GAP, "machine": describe_machine(), "groups": report,
    }, indent=2, allow_nan=False))
    plot(report, output.with_suffix(".png"))
    worst = max(row["gap"] for row in report.values())
    if worst > MAX_GAP:
        print(f"WARNING: live and teacher-forced acceptance differ by {worst:.3f} > {MAX_GAP} on the same texts.")
    return report
