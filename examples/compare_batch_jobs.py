"""Compares finished `hf-specformer generate` jobs on the same prompts: tokens/s, kappa and speed-up over the first.

    python examples/compare_batch_jobs.py --jobs plain=runs/plain drafter=runs/drafter suffix=runs/suffix \
        --output bench/batch_job_suffix

Reads each job's `progress/throughput0.json` (written by the job's process 0 at the end of its last session: run
each job in one session for a fair figure) and writes OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_specformer.data.records import PROGRESS_DIR, THROUGHPUT_FILE
from hf_specformer.targets import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", required=True, help="LABEL=JOB_DIR, the baseline first")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    jobs = dict(job.split("=", 1) for job in args.jobs)
    rows = {label: json.loads((Path(folder) / PROGRESS_DIR / THROUGHPUT_FILE.format(0)).read_text())
            for label, folder in jobs.items()}
    baseline = next(iter(rows.values()))["tokens_per_second"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_second"] / baseline
    print("| job | prompts | tokens | seconds | tokens/s | speed-up | kappa |\n|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        kappa = "-" if row["kappa"] is None else f"{row['kappa']:.2f}"
        print(f"| {label} | {row['num_prompts']} | {row['tokens']} | {row['seconds']:.1f} | "
              f"{row['tokens_per_second']:.1f} | {row['speedup']:.2f}x | {kappa} |")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({
        "jobs": jobs, "results": rows,
        "machine": describe_machine(),
    }, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = list(rows)
    axes[0].bar(labels, [rows[label]["tokens_per_second"] for label in labels])
    axes[0].set_title("tokens/s")
    axes[1].bar(labels, [rows[label]["kappa"] or 1.0 for label in labels])
    axes[1].set_title("kappa (tokens per row per forward)")
    for axis in axes:
        axis.tick_params(axis="x", labelrotation=20)  # long job labels must not overlap
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"))


if __name__ == "__main__":
    main()
