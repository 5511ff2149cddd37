"""How much a draft tree would add over the drafter's one chain: teacher-forced kappa of small trees, k = 3 deep.

    python examples/draft_tree_headroom.py [--drafter DIR] [--data NAME=DISTILLED_DIR ...] [--limit-per-group 5] \
        --output bench/smollm2_cpu_draft_tree_headroom

The engine verifies one chain of drafts per row: slot j's argmax. SpecFormer drafts every slot from the context in
one forward, so a second-best token at slot 1 comes for free; a tree verifies several branches in one target forward
(each branch attends to its own ancestors only) and keeps the longest accepted one. This script measures, before any
engine work, what such trees would accept: on the target's own texts, teacher-forced, it walks decoding steps as
`hf-specformer eval-drafter` does (`training.evaluation.tree_acceptance_steps`), taking at each step the longest
matching prefix over the tree's branches. For the chain this is eval-drafter's teacher-forced kappa, which matched
live decoding within 0.001 on MT-bench; a tree's figure is the headroom a lossless greedy tree verification would
reach, not a measured speed: each step also feeds the tree's nodes (`nodes`, against k for the chain) through the
target.

Texts: MT-bench's first turns (the shared data's file, `--limit-per-group` per category, as eval-drafter picks
them), each answered by the target's plain greedy `generate` at B = 1 with the chat template; and each `--data`
folder of distilled answers (e.g. the chat fine-tunes' held-out answers). Writes OUTPUT.json and OUTPUT.png.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import matplotlib
import torch
from tqdm.auto import tqdm

from hf_specformer.data.batching import cut_after_eos, eos_token_ids
from hf_specformer.apps.drafter_eval import MTBENCH_PROMPTS, select
from hf_specformer.data.prompts import chat_prompt_ids, find_shared_data, labelled_prompts
from hf_specformer.targets import load_drafter
from hf_specformer.targets import load_target, load_tokenizer
from hf_specformer.training.data import load_distilled
from hf_specformer.training.evaluation import draft_tokens, tree_acceptance_steps

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TREES = {
    "chain (the engine's)": [(0, 0, 0)],
    "+ slot 1's second token alone": [(0, 0, 0), (1,)],
    "+ slot 1's second token, then slots 2-3": [(0, 0, 0), (1, 0, 0)],
    "+ slot 1's second and third tokens, then slots 2-3": [(0, 0, 0), (1, 0, 0), (2, 0, 0)],
    "slots 1 and 2 two tokens each, then slot 3": [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)],
}
"""Tree name -> its branches: the rank (0 = argmax) of the token each branch takes at slots 1, 2, 3."""


def num_nodes(branches: list[tuple[int, ...]]) -> int:
    """Tokens a tree feeds besides the committed one: its distinct branch prefixes."""
    return len({branch[:depth] for branch in branches for depth in range(1, len(branch) + 1)})


def mtbench_texts(target, tokenizer, limit_per_group: int, max_new_tokens: int) -> list[dict]:
    """The target's plain greedy answers at B = 1 to MT-bench's first turns (none without the shared data)."""
    source = find_shared_data(MTBENCH_PROMPTS)
    if source is None:
        return []
    prompts, _ = select(*labelled_prompts([source], "category"), limit_per_group)
    eos = eos_token_ids(target, tokenizer)
    texts = []
    for prompt in tqdm(prompts, desc="MT-bench answers"):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        answer = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)[0, ids.shape[1]:]
        texts.append({"input_ids": ids[0].tolist() + cut_after_eos(answer.tolist(), eos),
                      "prompt_length": ids.shape[1]})
    return texts


@torch.no_grad()
def tree_kappas(target, drafter, texts, max_length: int) -> dict[str, float]:
    """Teacher-forced kappa of every tree of `TREES` on `texts` (rows with `input_ids` and `prompt_length`)."""
    depth = max(len(branch) for branches in TREES.values() for branch in branches)
    ranks = 1 + max(rank for branches in TREES.values() for branch in branches for rank in branch)
    steps = {name: [] for name in TREES}
    for row in tqdm(texts, desc="teacher-forced"):
        tokens = torch.tensor(row["input_ids"][:max_length])
        start = max(int(row["prompt_length"]) - 1, 0)
        ranked = draft_tokens(target, drafter, tokens, start, depth, ranks=ranks)
        for name, branches in TREES.items():
            steps[name].extend(tree_acceptance_steps(ranked, tokens, start, branches))
    return {name: sum(taken) / len(taken) for name, taken in steps.items()}


def plot(report: dict, path: Path) -> None:
    names = list(TREES)
    figure, axis = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(report["texts"])
    for offset, (text_name, result) in enumerate(report["texts"].items()):
        axis.bar([i + offset * width for i in range(len(names))], [result["kappa"][n] for n in names], width,
                 label=f"{text_name} ({result['num_texts']} texts)")
    axis.set_xticks([i + width * (len(report["texts"]) - 1) / 2 for i in range(len(names))],
                    [f"{textwrap.fill(n, 24)}\n{report['nodes'][n]} nodes" for n in names], fontsize=7)
    axis.set_ylim(1.0, None)
    axis.set_ylabel("teacher-forced kappa, k = 3")
    axis.set_title(f"Draft trees' headroom: {report['drafter']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--data", action="append", default=[], help="NAME=DIR: distilled answers to measure too")
    parser.add_argument("--limit-per-group", type=int, default=5, help="MT-bench prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=512, help="tokens of each text scored")
    parser.add_argument("--output", default="bench/draft_tree_headroom", help="writes OUTPUT.json and OUTPUT.png")
    args = parser.parse_args()
    named = dict(item.split("=", 1) for item in args.data)
    target = load_target()
    drafter = load_drafter(args.drafter, target).eval()
    texts = {"MT-bench": mtbench_texts(target, load_tokenizer(), args.limit_per_group, args.max_new_tokens)}
    texts.update({name: list(load_distilled(folder)) for name, folder in named.items()})
    report = {"drafter": args.drafter or "shipped", "trees": {n: [list(b) for b in t] for n, t in TREES.items()},
              "nodes": {name: num_nodes(branches) for name, branches in TREES.items()}, "texts": {}}
    for text_name, rows in texts.items():
        if rows:
            report["texts"][text_name] = {"num_texts": len(rows),
                                          "kappa": tree_kappas(target, drafter, rows, args.max_length)}
    if not report["texts"]:
        raise SystemExit("No texts: the shared MT-bench file is absent and no --data was given.")
    for text_name, result in report["texts"].items():
        print(f"{text_name} ({result['num_texts']} texts)")
        for name, kappa in result["kappa"].items():
            print(f"  {name:52s} {report['nodes'][name]:2d} nodes  kappa {kappa:.3f}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, output.with_suffix(".png"))


if __name__ == "__main__":
    main()
