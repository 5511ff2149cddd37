"""`hf-specformer` command line: demo, generate, synthesize, distill, train, calibrate, bench, eval-drafter, export.

    hf-specformer demo                      SmolLM2 + the shipped drafter: identical outputs, speedup
    hf-specformer synthesize --output F     the target writes user prompts itself (Magpie; resumable)
    hf-specformer generate --prompts P --output DIR   batch generation, speculative (resumable, sharded)
    hf-specformer distill --output DIR      the target answers prompts (resumable self-distillation data)
    hf-specformer train --data DIR ...      train a drafter (or: accelerate launch -m ...training.train_drafter)
    hf-specformer train-companion ...       train a Speculative Verification companion (also under accelerate)
    hf-specformer calibrate --data DIR ...  acceptance tables of drafter and companion, estimator comparison
    hf-specformer bench --output F          speculative vs plain generate, one interleaved run, JSON + PNG
    hf-specformer eval-drafter ...          a drafter's acceptance per category, teacher-forced and live
    hf-specformer serve                     an OpenAI-compatible server on speculative continuous batching
    hf-specformer export --drafter DIR ...  Hub folder: weights, code, custom_generate/, model card
    hf-specformer export-companion ...      a companion's Hub folder: weights, table, code, model card

A user's mistake (a changed run, a missing file, a bad value) prints one line and exits 2; set HF_SPECFORMER_DEBUG=1
for the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--push-to-hub", default=None, metavar="REPO", help="also publish the folder to this Hub repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")


def _maybe_push(folder, args: argparse.Namespace) -> None:
    if args.push_to_hub:
        from ..hub.export import push_folder

        print(push_folder(folder, args.push_to_hub, private=args.private))


def _export(argv: list[str]) -> None:
    from transformers import AutoModel

    from ..hub.cards import render_card
    from ..hub.export import export_drafter

    parser = argparse.ArgumentParser(prog="hf-specformer export", description="Write a drafter's Hub folder.")
    parser.add_argument("--drafter", required=True, help="a saved drafter folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--eval", default=None, help="eval.json of the training run")
    parser.add_argument("--bench", default=None, help="benchmark JSON to report in the card")
    parser.add_argument("--bench-call", default=None, help="the benchmark call to report (default: the first ours)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="draft only the N most frequent reply tokens of --draft-vocab-data (0: whole vocabulary)")
    parser.add_argument("--draft-vocab-data", default=None, help="distilled data the draft vocabulary is counted on")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="the default k that generate uses with this drafter (1..draft_length; default: kept)")
    _add_push_arguments(parser)
    args = parser.parse_args(argv)
    if args.draft_vocab_size and args.draft_vocab_data is None:
        parser.error("--draft-vocab-size N > 0 needs --draft-vocab-data")
    if args.draft_vocab_data is not None and args.draft_vocab_size is None:
        parser.error("--draft-vocab-data needs --draft-vocab-size")
    import torch

    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=torch.float32)
    if args.draft_vocab_size is not None:
        from ..training.data import load_distilled, reply_vocabulary

        vocabulary = reply_vocabulary(load_distilled(args.draft_vocab_data), args.draft_vocab_size) \
            if args.draft_vocab_size else None
        drafter.set_draft_vocab(vocabulary)
    if args.num_speculative_tokens is not None:
        if not 1 <= args.num_speculative_tokens <= drafter.config.draft_length:
            parser.error(f"--num-speculative-tokens must be between 1 and draft_length={drafter.config.draft_length}")
        drafter.config.num_speculative_tokens = args.num_speculative_tokens
    card = render_card(drafter, eval_path=args.eval, bench_path=args.bench, bench_call=args.bench_call,
                       name=Path(args.output).name)
    folder = export_drafter(drafter, args.output, model_card=card, dtype=getattr(torch, args.dtype))
    k = drafter.config.num_speculative_tokens
    kappa = (json.loads(Path(args.eval).read_text()).get("kappa") or [])[k - 1: k] if args.eval else []
    print(f"wrote {folder}: k = {k} of {drafter.config.draft_length} slots, {args.dtype}, "
          f"{drafter.num_parameters() / 1e6:.2f}M parameters" +
          (f", held-out kappa {kappa[0]:.2f} at k = {k}" if kappa and kappa[0] is not None else "") +
          (f", speeds from {args.bench}" if args.bench else ""))
    _maybe_push(folder, args)


def _export_companion(argv: list[str]) -> None:
    import torch
    from transformers import AutoModel

    from ..hub.cards import render_companion_card
    from ..hub.export import export_companion

    parser = argparse.ArgumentParser(prog="hf-specformer export-companion",
                                     description="Write a Speculative Verification companion's Hub folder.")
    parser.add_argument("--companion", required=True, help="a trained (and calibrated) companion folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--eval", default=None, help="companion_eval.json of the training run")
    parser.add_argument("--calibration", default=None, help="the report of `hf-specformer calibrate`")
    parser.add_argument("--bench", default=None, help="benchmark JSON with a `companion` schedule")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    _add_push_arguments(parser)
    args = parser.parse_args(argv)
    companion = AutoModel.from_pretrained(args.companion, trust_remote_code=True, dtype=torch.float32)
    card = render_companion_card(companion, eval_path=args.eval, calibration_path=args.calibration,
                                 bench_path=args.bench, name=Path(args.output).name)
    folder = export_companion(companion, args.output, model_card=card, dtype=getattr(torch, args.dtype))
    print(folder)
    _maybe_push(folder, args)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": lambda rest: __import__("hf_specformer.apps.demo", fromlist=["main"]).main(rest),
        "generate": lambda rest: __import__("hf_specformer.apps.batch_job", fromlist=["main"]).main(rest),
        "synthesize": lambda rest: __import__("hf_specformer.training.synthesize", fromlist=["main"]).main(rest),
        "distill": lambda rest: __import__("hf_specformer.training.distill", fromlist=["main"]).main(rest),
        "train": lambda rest: __import__("hf_specformer.training.train_drafter", fromlist=["main"]).main(rest),
        "train-companion": lambda rest: __import__(
            "hf_specformer.training.train_companion", fromlist=["main"]).main(rest),
        "calibrate": lambda rest: __import__("hf_specformer.training.calibrate", fromlist=["main"]).main(rest),
        "bench": lambda rest: __import__("hf_specformer.apps.bench", fromlist=["main"]).main(rest),
        "eval-drafter": lambda rest: __import__("hf_specformer.apps.drafter_eval", fromlist=["main"]).main(rest),
        "serve": lambda rest: __import__("hf_specformer.apps.serve", fromlist=["main"]).main(rest),
        "export": _export,
        "export-companion": _export_companion,
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        commands[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as error:  # a user's mistake: one line, as argparse reports its own
        if os.environ.get("HF_SPECFORMER_DEBUG"):
            raise
        print(f"hf-specformer {argv[0]}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
