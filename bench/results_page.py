"""Writes docs/results.md from the reports in bench/: one table per report, with the command behind it.

    python bench/results_page.py            # (`make bench` runs it after the benchmarks)
"""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).parent
REPORTS = {
    "smollm2_cpu_before_after": ("SmolLM2, MT-bench first turns: ours before and after the lean engine",
                                 "python bench/before_after.py --before WORKTREE_OF_c91b218 --prompts mtbench "
                                 "--min-rows 8 --batch-sizes 1 8 32 4 16 64 --output "
                                 "bench/smollm2_cpu_before_after"),
    "smollm2_cpu_before_after_b8": ("SmolLM2, MT-bench first turns: before and after at B = 8 with 64 rows",
                                    "python bench/before_after.py --before WORKTREE_OF_c91b218 --prompts mtbench "
                                    "--min-rows 32 --batch-sizes 8 --output bench/smollm2_cpu_before_after_b8"),
    "smollm2_cpu": ("SmolLM2, MT-bench first turns (`make bench`)",
                    "hf-specformer bench --prompts mtbench --min-rows 8 --output bench/smollm2_cpu"),
    "smollm2_cpu_passages": ("SmolLM2, summaries of and questions over 600-1,300-token passages",
                             "hf-specformer bench --prompts passages --batch-sizes 8 16 --output "
                             "bench/smollm2_cpu_passages"),
    "host_overhead": ("The host's cost per step (tiny random Llama, fp32, one thread)",
                      "hf-specformer bench --host-overhead --output bench/host_overhead"),
}
OTHER_REPORTS = {
    "smollm2_cpu_batch_job": "continuous batch job against static and transformers' `generate_batch` "
                             "(`examples/continuous_batching.py`, before the lean engine)",
    "smollm2_cpu_drafter_eval": "the shipped drafter's acceptance per MT-bench category (`hf-specformer eval-drafter`)",
    "smollm2_gpu_round_heldout": "the GPU training round that made the shipped drafter (held-out kappa)",
    "smollm2_shape_random_h100_bf16": "the one CUDA run on record: random weights of SmolLM2's shape, H100, bf16",
    "calibration_smollm2": "acceptance tables of the drafter and the companion (`hf-specformer calibrate`)",
    "smollm2_cpu_serve": "`hf-specformer serve` against `transformers serve --continuous-batching`, C concurrent "
                         "clients (`python bench/serve_load.py --concurrency 1 4 16 32 --output "
                         "bench/smollm2_cpu_serve`; docs/serving.md)",
    "smollm2_cpu_serve_poisson": "the three servers under open-loop Poisson arrivals, 1 request per second "
                                 "(`python bench/serve_load.py --poisson-rate 1.0 --output "
                                 "bench/smollm2_cpu_serve_poisson`)",
    "smollm2_cpu_serve_lossless": "256 greedy streamed requests from 32 clients against plain `generate`, without "
                                  "and with dropped clients (`python bench/serve_load.py --lossless --output "
                                  "bench/smollm2_cpu_serve_lossless`)",
    "smollm2_cpu_serve_soak": "ten minutes of `hf-specformer serve` at saturation with dropped and bad requests "
                              "(`python bench/serve_load.py --soak-seconds 600 --output bench/smollm2_cpu_serve_soak`)",
}


def speed_table(rows: list[dict]) -> list[str]:
    """Per call and batch size: speed-up over plain `generate` (and over plain + CPU backend), kappa, rows differing."""
    host = "ms_target_forward" in rows[0]
    head = ("| call | B | speed-up | ms per forward | target forward | drafting | rest |" if host else
            "| call | B | vs plain | vs plain+cpu | tokens/s | kappa | rows differing |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if host:
            lines.append(f"| {row['call']} | {row['batch_size']} | {row['speedup']:.2f}x | "
                         f"{row['ms_per_forward']:.2f} | {row['ms_target_forward']:.2f} | {row['ms_drafting']:.2f} | "
                         f"{row['ms_rest']:.2f} |")
        else:
            lines.append(f"| {row['call']} | {row['batch_size']} | {row['speedup']:.2f}x | "
                         f"{row.get('speedup_over_plain_cpu', float('nan')):.2f}x | {row['tokens_per_s']:.1f} | "
                         f"{row.get('kappa', 1.0):.2f} | {row['mismatched_rows']} |")
    return lines


def page() -> str:
    lines = ["# Current results", "",
             "Written by `python bench/results_page.py` from the reports in `bench/` (`make bench` reruns them). The",
             "CPU testbed is 2 shared cores: figures compare only within one report, whose calls ran interleaved on",
             "the same prompts. Earlier reports are in git history and [log.md](log.md).", ""]
    for stem, (title, command) in REPORTS.items():
        path = BENCH / f"{stem}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        lines += [f"## {title}", "", f"`{command}` -> `bench/{stem}.json`, `.png`; machine: "
                  f"{report['machine'].get('cpu')}, {report['machine'].get('threads')} threads, torch "
                  f"{report['machine'].get('torch')}.", "", *speed_table(report["results"]), ""]
    lines += ["## Other reports", ""]
    lines += [f"- `bench/{stem}.json`: {text}" for stem, text in OTHER_REPORTS.items()
              if (BENCH / f"{stem}.json").exists()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else BENCH.parent / "docs" / "results.md"
    target.write_text(page())
    print(target)
