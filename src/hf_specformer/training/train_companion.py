"""Train a Speculative Verification companion by self-distillation on the target's own answers.

    accelerate launch -m hf_specformer.training.train_companion --data D --output C --vocab-from DRAFTER_DIR
    hf-specformer train-companion --data D --output C ...           (the same, one process)

Each reply position t gives the target's last state at t, the chain x_{t+1..t+k} and labels x_{t+2..t+k+1}
(cross-entropy over the companion vocabulary). Checkpoints resume exactly.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from hf_specformer.models import CompanionConfig, CompanionForVerification
from hf_specformer.targets import load_data_target
from hf_specformer.training.checkpointing import (StopOnSignal, TrainerState, end_process_group, list_checkpoints,
                                                  restore_checkpoint, save_checkpoint)
from hf_specformer.training.data import load_distilled, split_train_eval
from hf_specformer.training.target_states import reply_positions, target_hidden_states, tokens_after
from hf_specformer.training.optimization import warmup_cosine

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass
class CompanionTrainingConfig:
    """Options of `train_companion` (the command line maps onto these names)."""

    data: str
    output: str
    target: str | None = None  # None: the one the data was distilled from
    vocab_from: str | None = None
    companion_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 768
    chain_length: int = 4
    max_length: int = 512
    steps: int = 600
    batch_size: int = 512
    learning_rate: float = 2e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.01
    eval_fraction: float = 0.05
    save_every: int = 200
    seed: int = 0
    threads: int | None = None
    resume: bool = False


@dataclass
class ChainData:
    """Examples of one split: per reply position, the target's last state `[N, d]`, the chain `[N, k]` and the
    labels `[N, k]` (IGNORE past a sequence's end or outside the companion vocabulary)."""

    states: torch.Tensor
    chains: torch.LongTensor
    labels: torch.LongTensor

    def __len__(self) -> int:
        return self.states.shape[0]

    def select(self, index: torch.LongTensor) -> "ChainData":
        return ChainData(self.states[index], self.chains[index], self.labels[index])


@torch.no_grad()
def chain_examples(target, dataset, chain_length: int, max_length: int, label_index: torch.LongTensor,
                   progress: bool = True) -> ChainData:
    """One example per reply position of every sequence (labels mapped through `label_index` `[V]`)."""
    states, chains, labels = [], [], []
    for row in tqdm(dataset, desc="target states", disable=not progress, leave=False):
        ids = torch.tensor(row["input_ids"][:max_length], device=target.device)
        positions = reply_positions(ids, row["prompt_length"])
        if positions.numel() == 0:
            continue
        last = target_hidden_states(target, ids[None], torch.ones_like(ids)[None])[-1][0]  # [T, d]
        chain = tokens_after(ids, positions, 1, chain_length)
        label = tokens_after(ids, positions, 2, chain_length)
        states.append(last[positions].float().cpu())
        chains.append(chain.clamp(min=0).cpu())
        labels.append(torch.where(label >= 0, label_index[label.clamp(min=0).cpu()], IGNORE).cpu())
    return ChainData(torch.cat(states), torch.cat(chains), torch.cat(labels))


def label_index_of(companion: CompanionForVerification, vocab_size: int) -> torch.LongTensor:
    """`[V]` token id -> index among the companion's vocabulary ids (IGNORE for tokens outside it)."""
    if companion.vocab_ids is None:
        return torch.arange(vocab_size)
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    index[companion.vocab_ids.cpu()] = torch.arange(companion.vocab_ids.numel())
    return index


def build_companion(config: CompanionTrainingConfig, target) -> CompanionForVerification:
    """A fresh companion for `target`, on the drafter's draft vocabulary with `vocab_from`."""
    torch.manual_seed(config.seed)
    companion_config = CompanionConfig.from_target_config(
        target.config, companion_size=config.companion_size, num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size, max_chain_length=max(8, config.chain_length),
    )
    companion = CompanionForVerification(companion_config).to(device=target.device, dtype=target.dtype)
    companion.bind_target(target)
    if config.vocab_from:
        from transformers import AutoModel

        drafter = AutoModel.from_pretrained(config.vocab_from, trust_remote_code=True)
        companion.set_vocab(drafter.draft_vocab_ids)
    return companion


def chain_loss(companion: CompanionForVerification, batch: ChainData) -> torch.Tensor:
    """Mean cross-entropy of the companion's vocabulary logits against the labels."""
    device = companion.device
    states = companion(hidden_states=batch.states.to(device), input_ids=batch.chains.to(device),
                       return_logits=False).hidden_states
    logits = companion.vocab_logits(states).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.to(device).flatten(),
                                             ignore_index=IGNORE)


@torch.no_grad()
def evaluate(companion: CompanionForVerification, data: ChainData, batch_size: int = 4096) -> dict:
    """Held-out cross-entropy and top-1 accuracy per chain position."""
    correct = torch.zeros(data.labels.shape[1])
    counted = torch.zeros(data.labels.shape[1])
    losses = []
    for start in range(0, len(data), batch_size):
        batch = data.select(torch.arange(start, min(start + batch_size, len(data))))
        losses.append(float(chain_loss(companion, batch)) * len(batch))
        states = companion(hidden_states=batch.states.to(companion.device), input_ids=batch.chains.to(companion.device),
                           return_logits=False).hidden_states
        predictions = companion.vocab_logits(states).argmax(-1).cpu()
        valid = batch.labels != IGNORE
        correct += ((predictions == batch.labels) & valid).sum(0)
        counted += valid.sum(0)
    return {"cross_entropy": sum(losses) / max(len(data), 1),
            "accuracy_by_position": (correct / counted.clamp(min=1)).tolist()}


def train_companion(config: CompanionTrainingConfig, target=None, dataset=None, progress: bool = True) -> dict:
    """Trains (or resumes) a companion and saves it to `config.output` (`save_pretrained`); returns its evaluation.
    `target` and `dataset` replace loading `config.target` and `config.data` (tests pass tiny ones)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = Accelerator()
    output = Path(config.output)
    target = target if target is not None else load_data_target(config.data, config.target, device=accelerator.device)
    companion = build_companion(config, target)
    dataset = dataset if dataset is not None else load_distilled(config.data)
    train_rows, eval_rows = split_train_eval(dataset, config.max_length, config.eval_fraction, config.seed)
    label_index = label_index_of(companion, target.config.vocab_size)
    train_data = chain_examples(target, train_rows, config.chain_length, config.max_length, label_index, progress)
    eval_data = chain_examples(target, eval_rows, config.chain_length, config.max_length, label_index, progress)
    logger.info("%d training and %d held-out chain examples", len(train_data), len(eval_data))

    parameters = [p for p in companion.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.steps, config.warmup_ratio, 0.1))
    companion, optimizer, scheduler = accelerator.prepare(companion, optimizer, scheduler)
    state = TrainerState()
    checkpoints = list_checkpoints(output)
    if config.resume and checkpoints:
        state = restore_checkpoint(accelerator, checkpoints[-1])
        logger.info("resumed from %s (step %d)", checkpoints[-1], state.step)
    model = accelerator.unwrap_model(companion)
    model.train()
    bar = tqdm(total=config.steps, initial=state.step, desc="companion", disable=not progress)
    with StopOnSignal() as stop:
        while state.step < config.steps:
            generator = torch.Generator().manual_seed(config.seed * 100_003 + state.step * 101
                                                      + accelerator.process_index)
            index = torch.randint(len(train_data), (config.batch_size,), generator=generator)
            loss = chain_loss(model, train_data.select(index))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(companion.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            state.step += 1
            state.metrics = {"loss": loss.detach().item()}
            bar.update(1)
            bar.set_postfix(loss=f"{state.metrics['loss']:.3f}")
            if state.step % config.save_every == 0 or stop.agreed(accelerator):
                save_checkpoint(accelerator, output, state)
                if stop.requested:
                    logger.warning("stopped at step %d; continue with --resume", state.step)
                    return {"stopped_at": state.step}
    bar.close()
    model.eval()
    evaluation = {"steps": state.step, "examples": len(train_data), **evaluate(model, eval_data)}
    if accelerator.is_main_process:
        model.save_pretrained(output)
        report = json.dumps({"config": asdict(config), **evaluation}, indent=2, allow_nan=False)
        (output / "companion_eval.json").write_text(report)
    return evaluation


def parse_config(argv: list[str] | None = None) -> CompanionTrainingConfig:
    """Command-line options of `hf-specformer train-companion` (one per `CompanionTrainingConfig` field)."""
    parser = argparse.ArgumentParser(prog="hf-specformer train-companion", description=__doc__.split("\n\n")[0])
    for name, default in asdict(CompanionTrainingConfig(data="", output="")).items():
        flag = "--" + name.replace("_", "-")
        if name in ("data", "output"):
            parser.add_argument(flag, required=True)
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            kind = type(default) if default is not None else (int if name == "threads" else str)
            parser.add_argument(flag, type=kind, default=default)
    return CompanionTrainingConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    evaluation = train_companion(parse_config(argv))
    end_process_group()
    print(json.dumps(evaluation, indent=2))
    return evaluation


if __name__ == "__main__":
    main()
