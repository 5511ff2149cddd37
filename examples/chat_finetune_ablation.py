"""The ablation of `examples/train_chat_drafter.sh`: held-out kappa per change, and MT-bench per drafter.

    python examples/chat_finetune_ablation.py --run runs/chat \
        --mtbench shipped=bench/smollm2_cpu_drafter_eval.json --mtbench soft=runs/chat/mtbench_eval_soft.json \
        --output bench/smollm2_cpu_chat_finetune_ablation

Reads each fine-tune's `eval.json` (teacher-forced kappa at k = 1..8 on the run's held-out answers, the shipped
drafter's as "initial"), counts how much of the held-out answers each draft vocabulary covers, and reads
`eval-drafter` reports on MT-bench (k = 3: teacher-forced, live, live with lookup).
Writes OUTPUT.json and OUTPUT.png (held-out kappa by k per drafter).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from hf_specformer import SpecFormerForDrafting
from hf_specformer.targets import shipped_drafter_dir
from hf_specformer.training.data import load_distilled, reply_token_counts, reply_vocabulary

FINE_TUNES = {"hard": "hard labels", "soft": "hard + soft labels (forward KL, weight 1)",
              "lora": "LoRA r = 16, lr 2e-3, 1 epoch, hard labels",
              "vocab3": "draft-vocabulary loss, slots 1-3, every position, hard labels",
              "vocab3soft": "draft-vocabulary loss, slots 1-3, every position, hard + soft labels (weight 1)",
              "vocab3more": "draft-vocabulary loss, slots 1-3, every position, hard labels, + a second prompt set's "
                            "answers (2.9x the reply tokens)",
              "vocab3more2": "the previous row, trained on from its weights on a third prompt set's 2,000 answers "
                             "(lr 2e-4, 2 epochs)",
              "vocab3more3": "the previous row, trained on from its weights on a fourth prompt set's 3,079 answers "
                             "(lr 2e-4, 2 epochs)",
              "vocab3more4": "the previous row, trained on from its weights on a fifth prompt set's 3,249 answers "
                             "(lr 2e-4, 2 epochs)",
              "vocab3more5": "the previous row, trained on from its weights on a sixth prompt set's 2,042 answers "
                             "(lr 2e-4, 2 epochs; not shipped)"}


def held_out(run: Path) -> dict[str, list[float]]:
    """Teacher-forced kappa at k = 1..8 on the run's held-out answers: the drafter they all start from, then each
    fine-tune the run holds."""
    reports = {name: json.loads((run / name / "eval.json").read_text()) for name in FINE_TUNES
               if (run / name / "eval.json").exists()}
    kappas = {"starting drafter": next(iter(reports.values()))["initial"]["kappa"]}
    kappas.update({FINE_TUNES[name]: report["kappa"] for name, report in reports.items()})
    return kappas


def vocabulary_coverage(run: Path, size: int = 8192) -> dict[str, float]:
    """Share of the held-out answers' reply tokens inside the shipped draft vocabulary, and inside the `size` most
    frequent reply tokens of the run's training answers."""
    held_out_replies = reply_token_counts(load_distilled(run / "distill_heldout"))
    vocabularies = {
        "shipped draft vocabulary": set(SpecFormerForDrafting.from_pretrained(shipped_drafter_dir())
                                        .draft_vocab_ids.tolist()),
        f"recounted on the chat answers ({size})": set(reply_vocabulary(load_distilled(run / "distill_train"), size)),
    }
    total = sum(held_out_replies.values())
    return {name: sum(held_out_replies[token] for token in vocabulary) / total
            for name, vocabulary in vocabularies.items()}


def prompts_by_category(run: Path) -> dict[str, int]:
    """How many of the run's synthesized prompts each category kept."""
    lines = (run / "prompts.jsonl").read_text().splitlines()
    return dict(Counter(json.loads(line)["category"] for line in lines).most_common())


def mtbench(path: Path) -> dict[str, float]:
    """MT-bench over all categories, k = 3: teacher-forced and live kappa, live slot-1 acceptance, kappa with lookup."""
    everything = json.loads(path.read_text())["groups"]["all"]
    return {"teacher_forced_kappa": everything["teacher_forced"]["kappa"][-1],
            "live_kappa": everything["live"]["kappa"], "live_slot1": everything["live"]["slot_acceptance"][0],
            "live_kappa_with_lookup": everything.get("live_lookup", {}).get("kappa"),
            "mismatched_rows": everything["live"]["mismatched_rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the OUT folder of train_chat_drafter.sh")
    parser.add_argument("--mtbench", action="append", default=[], metavar="NAME=JSON",
                        help="an eval-drafter report on MT-bench (repeat)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    kappas = held_out(Path(args.run))
    report = {"prompts_by_category": prompts_by_category(Path(args.run)), "held_out_kappa_by_k": kappas,
              "held_out_vocabulary_coverage": vocabulary_coverage(Path(args.run)),
              "mtbench": {name: mtbench(Path(path)) for name, path in (item.split("=", 1) for item in args.mtbench)}}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=2))
    for name, values in kappas.items():
        print(f"{name}: held-out kappa at k = 3 {values[2]:.3f}")
    for name, values in report["mtbench"].items():
        print(f"MT-bench, {name}: {values}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    for name, values in kappas.items():
        axis.plot(range(1, len(values) + 1), values, marker="o", label=name)
    axis.set_xlabel("drafts per step k")
    axis.set_ylabel("held-out kappa (teacher-forced)")
    axis.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1)
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"), bbox_inches="tight")


if __name__ == "__main__":
    main()
