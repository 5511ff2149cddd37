"""Speculative Verification companion: its own distribution P_c at each drafted position, for acceptance estimates.

Reference: Kim et al., "Speculative Verification: Exploiting Information Gain to Refine Speculative Decoding",
arXiv 2509.24328. The paper's companion is an off-the-shelf small LM of the draft's family. A drafter on the target's
hidden states (SpecFormer) has no such sibling, so ours is a small module on the same frozen target.

Data flow for a row whose last accepted input is at position t, with k drafts (B rows, c = companion width):

    h_t: the target's last hidden state at t (after its final norm; its lm_head gives x_{t+1})        [B, d]
    chain: x_{t+1} (the committed token), d_1 .. d_{k-1} (the drafts)                                   [B, k]
    W_in . [RMSNorm(h_t) ; RMSNorm(embed(chain_j))] + position_j                                        [B, k, c]
    -> (causal self-attention over the chain) + residual -> (SwiGLU) + residual -> W_out (c -> d)    [B, k, d]
    -> the target's final norm -> the target's lm_head (companion vocabulary rows) -> logits           [B, k, V]

Position j scores draft d_{j+1}. It reads the drafted tokens, which SpecFormer drafts without seeing (the information
SV needs: whether d_2 follows from d_1); the target's state at t summarises the context, so it needs no cache; its
final norm, lm_head and embeddings are the target's, bound at run time. Trained by self-distillation with the true
continuation as the chain (`hf-specformer train-companion`).

This file is shipped to the Hub as remote code: it imports only torch, transformers and its sibling config.
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .configuration_companion import CompanionConfig


# Copied from modeling_specformer.SpecFormerRMSNorm (remote code is one self-contained file per model)
class CompanionRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 (float64 for float64 inputs) and cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CompanionChainBlock(nn.Module):
    """Pre-norm causal self-attention over the chain, then a pre-norm SwiGLU: `[B, k, c]` -> `[B, k, c]`."""

    def __init__(self, config: CompanionConfig):
        super().__init__()
        width = config.companion_size
        self.num_heads = config.num_attention_heads
        self.attention_norm = CompanionRMSNorm(width, eps=config.rms_norm_eps)
        self.qkv_proj = nn.Linear(width, 3 * width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.mlp_norm = CompanionRMSNorm(width, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        batch, length, width = states.shape
        qkv = self.qkv_proj(self.attention_norm(states)).view(batch, length, 3, self.num_heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, k, c / heads]
        attended = nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
        states = states + self.o_proj(attended.transpose(1, 2).reshape(batch, length, width))
        hidden = self.mlp_norm(states)
        return states + self.down_proj(nn.functional.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


@dataclass
class CompanionOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor` of shape `[B, k, V]`): P_c's logits at the drafted positions (-inf outside the
            companion vocabulary).
        hidden_states (`torch.FloatTensor` of shape `[B, k, d]`): the states fed to the target's final norm.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None


class CompanionPreTrainedModel(PreTrainedModel):
    config: CompanionConfig
    base_model_prefix = "companion"
    _no_split_modules = ["CompanionChainBlock"]

    save_hooks: ClassVar[list[Callable[[PreTrainedModel, str | os.PathLike], None]]] = []
    """As `SpecFormerPreTrainedModel.save_hooks`."""

    # Copied from modeling_specformer.SpecFormerPreTrainedModel.save_pretrained
    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            for hook in self.save_hooks:
                hook(self, save_directory)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, CompanionRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, CompanionForVerification) and module.vocab_ids is not None:
            init.copy_(module.vocab_ids, torch.arange(module.vocab_ids.numel()))  # placeholder ids


class CompanionForVerification(CompanionPreTrainedModel):
    """Speculative Verification companion. Bind it to its target (`bind_target`) before calling it.

    Example:
        >>> companion = CompanionForVerification(CompanionConfig.from_target_config(target.config)).bind_target(target)
        >>> out = target(input_ids, output_hidden_states=True)
        >>> h = out.hidden_states[-1][:, -1]                       # [B, d] state at the last accepted input
        >>> chain = torch.cat([next_token[:, None], drafts[:, :-1]], 1)   # [B, k]
        >>> companion(hidden_states=h, input_ids=chain).logits.shape      # [B, k, V]
    """

    def __init__(self, config: CompanionConfig):
        super().__init__(config)
        self.state_norm = CompanionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.token_norm = CompanionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * config.hidden_size, config.companion_size, bias=False)
        self.position_embeddings = nn.Embedding(config.max_chain_length, config.companion_size)
        self.block = CompanionChainBlock(config)
        self.output_norm = CompanionRMSNorm(config.companion_size, eps=config.rms_norm_eps)
        self.output_proj = nn.Linear(config.companion_size, config.hidden_size, bias=False)
        vocab_ids = None if config.companion_vocab_size is None else torch.arange(config.companion_vocab_size)
        self.register_buffer("vocab_ids", vocab_ids, persistent=True)  # [V_c] or None
        self._target: tuple[nn.Module, nn.Module, nn.Module] | None = None  # (embeddings, final norm, lm_head)
        self.post_init()

    # ----- binding to the target -------------------------------------------------------------------------------
    def bind_target(self, target: PreTrainedModel) -> "CompanionForVerification":
        """Shares the target's input embeddings, final norm and lm_head (not copied, not saved) after checking
        hidden and vocabulary sizes and the model type. Raises `ValueError` on a mismatch."""
        text_config = target.config.get_text_config()
        expected = {"hidden_size": self.config.hidden_size, "vocab_size": self.config.vocab_size}
        if self.config.target_model_type is not None:
            expected["model_type"] = self.config.target_model_type
        mismatched = {
            name: (want, getattr(text_config, name, None))
            for name, want in expected.items() if getattr(text_config, name, None) != want
        }
        if mismatched:
            details = ", ".join(f"{name}: companion {want} vs target {got}" for name, (want, got) in mismatched.items())
            raise ValueError(
                f"This companion was built for {self.config.target_name_or_path or 'another target'} and does not "
                f"match the target it is bound to ({details})."
            )
        lm_head, final_norm = target.get_output_embeddings(), getattr(target.get_decoder(), "norm", None)
        if lm_head is None or final_norm is None:
            raise ValueError(f"{type(target).__name__} has no final `norm` and `lm_head` for the companion to share.")
        self._target = (target.get_input_embeddings(), final_norm, lm_head)
        return self

    @property
    def is_bound(self) -> bool:
        """Whether `bind_target` has attached a target."""
        return self._target is not None

    def is_bound_to(self, target: PreTrainedModel) -> bool:
        """Whether this companion shares `target`'s lm_head."""
        return self._target is not None and self._target[2] is target.get_output_embeddings()

    def set_vocab(self, token_ids: Sequence[int] | torch.Tensor | None) -> "CompanionForVerification":
        """Restricts P_c to `token_ids` (saved with the weights), or lifts the restriction with None."""
        if token_ids is None:
            self.vocab_ids, self.config.companion_vocab_size = None, None
            return self
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= self.config.vocab_size or ids.unique().numel() != len(ids):
            raise ValueError(f"A companion vocabulary needs distinct token ids in [0, {self.config.vocab_size}).")
        self.vocab_ids = ids.to(self.device)
        self.config.companion_vocab_size = ids.numel()
        return self

    def _bound(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        if self._target is None:
            raise RuntimeError("Call `companion.bind_target(target)` before running the companion.")
        return self._target

    def vocab_logits(self, states: torch.Tensor) -> torch.Tensor:
        """`[..., d]` -> `[..., V_c]` (`[..., V]` without a companion vocabulary): the target's final norm, then the
        lm_head rows of the companion vocabulary (what training scores)."""
        _, final_norm, lm_head = self._bound()
        normalized = final_norm(states.to(lm_head.weight.dtype))
        if self.vocab_ids is None:
            return lm_head(normalized)
        return nn.functional.linear(normalized, lm_head.weight[self.vocab_ids])

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """`[..., d]` -> `[..., V]`: `vocab_logits` in the full vocabulary, other tokens at -inf."""
        rows = self.vocab_logits(states)
        if self.vocab_ids is None:
            return rows
        logits = rows.new_full((*rows.shape[:-1], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(logits.ndim - 1, self.vocab_ids, rows)

    # ----- forward ---------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.LongTensor,
                return_logits: bool = True) -> CompanionOutput:
        r"""
        Args:
            hidden_states (`[B, d]`): the target's last hidden state (after its final norm) at each row's last
                accepted input.
            input_ids (`[B, k]`): the chain: the token the target committed after that input, then drafts
                d_1 .. d_{k-1}.
            return_logits: with False only `hidden_states` `[B, k, d]` are returned (training scores them).
        Returns:
            `CompanionOutput` with logits `[B, k, V]` for the positions of d_1 .. d_k.
        """
        if hidden_states.ndim != 2 or input_ids.ndim != 2 or hidden_states.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"Expected hidden_states [B, d] and input_ids [B, k], got {tuple(hidden_states.shape)} and "
                f"{tuple(input_ids.shape)}."
            )
        length = input_ids.shape[1]
        if not 1 <= length <= self.config.max_chain_length:
            raise ValueError(f"A chain of {length} positions; this companion scores 1..{self.config.max_chain_length}.")
        embeddings = self._bound()[0](input_ids).to(self.dtype)  # [B, k, d]
        state = self.state_norm(hidden_states.to(self.dtype))[:, None].expand_as(embeddings)
        chain = self.input_proj(torch.cat([state, self.token_norm(embeddings)], dim=-1))
        chain = chain + self.position_embeddings.weight[:length]
        states = self.output_proj(self.output_norm(self.block(chain)))  # [B, k, d]
        logits = self.compute_logits(states) if return_logits else None
        return CompanionOutput(logits=logits, hidden_states=states)


__all__ = ["CompanionForVerification", "CompanionOutput", "CompanionPreTrainedModel"]
