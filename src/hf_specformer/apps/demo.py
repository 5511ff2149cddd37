"""The main job on the embedded default: SmolLM2-135M-Instruct with the shipped SpecFormer drafter, against plain
`generate`, on a fixed mixed set of prompts (chat, a summary and a question over a long passage, code).

Every prompt alone (B = 1), and a continuous batch job against static batches of plain `generate` (on the CPU also
under `cpu_products`); prints a table, checks every output and saves `outputs/demo.png`.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

from ..cpu import cpu_products
from ..data.batching import cut_after_eos
from ..data.prompts import CODE_PROMPTS, chat_prompt_ids, interleaved, load_prompts, passage_prompts
from ..generation import generate, generate_batch
from ..targets import DEFAULT_TARGET, DTYPES, default_device, load_drafter, load_target, load_tokenizer, timed


def demo_prompts(count: int) -> list[str]:
    """`count` prompts taken in turn from: chat (the shipped set), a summary of and a question over the shortest
    passage, code."""
    passages = passage_prompts()  # a summary, then a question, per passage
    shortest = min(range(0, len(passages), 2), key=lambda i: len(passages[i]))
    groups = [load_prompts(None), passages[shortest: shortest + 2], list(CODE_PROMPTS)]
    return interleaved(groups)[:count]


def _answers(sequences: torch.LongTensor, width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens (after the prompts' `width`) up to its first EOS."""
    return [cut_after_eos(row[width:], eos) for row in sequences.tolist()]


def run_jobs(target, tokenizer, drafter, prompts: list[str], slots: int, max_new_tokens: int,
             schedule: str = "goodput") -> list[dict]:
    """The two jobs (see the module docstring), speculation on `schedule` -> one row each: seconds of every call,
    speedups, kappa, identical."""
    cpu = target.device.type == "cpu"
    backend = (lambda: cpu_products(target, drafter)) if cpu else contextlib.nullcontext
    eos = {tokenizer.eos_token_id}
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    speculation = {"schedule": schedule}
    ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]

    def static(rows: list[list[int]], speculative: bool):
        width = max(map(len, rows))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
        if not speculative:
            return _answers(target.generate(input_ids=input_ids, attention_mask=mask, **kwargs), width, eos), None
        output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter,
                          return_dict_in_generate=True, speculation_config=speculation, **kwargs)
        stats = output.speculation_stats
        return _answers(output.sequences, width, eos), (stats.row_steps, stats.accepted)

    def plain_job(groups, under_backend: bool):
        with cpu_products(target) if under_backend else contextlib.nullcontext():
            return [answer for group in groups for answer in static(group, False)[0]], None

    def ours_alone():
        with backend():
            results = [static([row], True) for row in ids]
        return [r[0][0] for r in results], tuple(map(sum, zip(*(r[1] for r in results))))

    def ours_batch():
        with backend():
            outputs = generate_batch(target, ids, assistant_model=drafter, max_batch_size=slots, progress_bar=False,
                                     speculation_config=speculation, **kwargs)
        return [o.generated_tokens for o in outputs], (sum(o.steps for o in outputs),
                                                      sum(o.accepted_drafts for o in outputs))

    jobs = {"each prompt alone (B = 1)": ([[row] for row in ids], ours_alone),
            f"batch job ({len(ids)} prompts, {slots} slots)": ([ids[i: i + slots] for i in range(0, len(ids), slots)],
                                                              ours_batch)}
    target.generate(input_ids=torch.tensor([ids[0]], device=target.device), max_new_tokens=2, do_sample=False)
    rows = []
    for job, (groups, ours) in jobs.items():
        (reference, _), plain = timed(lambda: plain_job(groups, False), target.device)
        (answers, (steps, accepted)), seconds = timed(ours, target.device)
        row = {"job": job, "prompts": len(ids), "plain_seconds": plain, "seconds": seconds, "speedup": plain / seconds,
               "kappa": (steps + accepted) / max(steps, 1), "identical": answers == reference,
               "differing_rows": sum(a != r for a, r in zip(answers, reference))}
        if cpu:
            (cpu_answers, _), row["plain_cpu_seconds"] = timed(lambda: plain_job(groups, True), target.device)
            row["speedup_over_plain_cpu"] = row["plain_cpu_seconds"] / seconds
            row["identical"] &= cpu_answers == reference
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cpu = "plain_cpu_seconds" in rows[0]
    header = "| job | plain generate | " + ("plain + CPU backend | " if cpu else "") + \
        "speculative | speedup | " + ("over CPU backend | " if cpu else "") + "kappa | identical |"
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        cells = [r["job"], f"{r['plain_seconds']:.1f} s"] + ([f"{r['plain_cpu_seconds']:.1f} s"] if cpu else []) + \
            [f"{r['seconds']:.1f} s", f"{r['speedup']:.2f}x"] + \
            ([f"{r['speedup_over_plain_cpu']:.2f}x"] if cpu else []) + [f"{r['kappa']:.2f}", str(r["identical"])]
        print("| " + " | ".join(cells) + " |")


def plot(rows: list[dict], path: Path) -> Path:
    """Seconds of each call per job, with the speedups, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = [("plain_seconds", "plain generate")] + \
        ([("plain_cpu_seconds", "plain + CPU backend")] if "plain_cpu_seconds" in rows[0] else []) + \
        [("seconds", "speculative")]
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(calls)
    for index, (key, label) in enumerate(calls):
        axis.bar([x + (index - (len(calls) - 1) / 2) * width for x in range(len(rows))], [r[key] for r in rows],
                 width, label=label)
    for x, row in enumerate(rows):
        axis.annotate(f"{row['speedup']:.2f}x, kappa {row['kappa']:.2f}", (x, max(row["plain_seconds"],
                      row["seconds"])), ha="center", va="bottom", fontsize=8)
    axis.set_xticks(range(len(rows)), [row["job"] for row in rows], fontsize=8)
    axis.set_ylabel("seconds (same prompts, same outputs)")
    axis.set_title("SmolLM2-135M-Instruct + SpecFormer drafter")
    axis.legend(fontsize=8)
    axis.margins(y=0.2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specformer demo", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--prompts", type=int, default=12, help="prompts of the mixed set (default: %(default)s)")
    parser.add_argument("--slots", type=int, default=4, help="rows at once in the batch job (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--schedule", choices=["goodput", "fixed"], default="goodput",
                        help="how many drafts to verify: goodput (each step's best, 0 included) or fixed (all k)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--plot", default="outputs/demo.png", help="PNG of the timings ('' for none)")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target = load_target(args.target, dtype=DTYPES[args.dtype], device=args.device or default_device())
    tokenizer = load_tokenizer(args.target)
    drafter = load_drafter(args.drafter, target)
    print(f"target: {args.target}; drafter: {drafter.num_parameters() / 1e6:.2f}M parameters, "
          f"k = {drafter.config.num_speculative_tokens}, on {target.device}")
    rows = run_jobs(target, tokenizer, drafter, demo_prompts(args.prompts), args.slots, args.max_new_tokens,
                    args.schedule)
    print_table(rows)
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}")
    if not all(row["identical"] for row in rows):
        raise SystemExit("Speculative output differs from plain generate.")
    return rows
