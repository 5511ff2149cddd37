"""SpecFormer drafter: a non-autoregressive draft module on a frozen target's hidden states.

Reference: Shi et al., "Scaling LLM Speculative Decoding: Non-Autoregressive Forecasting in Large-Batch
Scenarios", AAAI-26 (arXiv 2511.20340), eqs. 8-10; official code github.com/ShiLuohe/SpecFormer.

Data flow for new positions t of one forward (B = batch, T = new positions, d = hidden, l_d = slots, P = positions
asked for, k = drafts):

    4 hooked target states [B, T, 4, d] -> grouped RMSNorm -> concat [B, T, 4d] -> W_D (4d -> d, no bias)
    [+ W_E . RMSNorm(embedding of x_{t+1})]                           # only with config.next_token_input
    -> (causal self-attention with RoPE over the context, own KV cache) + residual       # eq. 8, "layer L+1"
    -> gather the P positions asked for [B, P, d]
    -> RMSNorm -> positional FFN W_P (d -> l_d * d, with bias) -> [B * P, l_d, d]          # eq. 9
    -> (bidirectional self-attention across the l_d slots, no mask, no RoPE) + residual
    -> (SwiGLU) + residual -> first k slots                                              # eq. 10
    -> the target's final norm -> the target's lm_head -> logits [B, P, k, V]

Slot j at position t predicts token x_{t+2+j}: the target's own head at t already predicts x_{t+1}.

Choices where the paper is silent (documented here once):
- The slot stage runs only at the positions asked for (`draft_positions`, default: the last one): it is the dear part.
- All l_d slots take part in the slot attention and only the first k reach the SwiGLU and the head, as in the
  official code (`set_max_predict`), so k <= l_d may change per call. The slot attention has no RoPE.
- The final norm and lm_head are the target's, attached at run time by `bind_target` (which checks the target),
  never saved. Extension (`config.next_token_input`): position t also reads x_{t+1} through the target's embeddings.

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
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_specformer import SpecFormerConfig

try:  # optional fused kernels of the hf_specformer package; remote code without the package runs PyTorch only
    import hf_specformer.kernels as _kernels
except ImportError:
    _kernels = None

NUM_HOOKED_STATES = 4


class SpecFormerRMSNorm(nn.Module):
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


class SpecFormerGroupedRMSNorm(SpecFormerRMSNorm):
    """RMSNorm of each of the 4 hooked states with its own scale vector (paper: GroupRMS).

    Input `[..., num_groups, d]`, output the same shape; `weight` is `[num_groups, d]`, initialised to 1. One tensor
    op for all groups instead of the official code's Python loop over 4 norms.
    """

    def __init__(self, num_groups: int, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(num_groups, hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[..., G, d]` -> `[..., G, d]`; outside autograd, the fused kernel of `hf_specformer.kernels` where its
        dispatcher picks Triton (GPUs by default), else the PyTorch code (also when this file runs without the
        package, as Hub remote code)."""
        if _kernels is not None and not torch.is_grad_enabled() and _kernels.use_triton(hidden_states):
            fused = _kernels.load("rms_norm").grouped_rms_norm(hidden_states, self.weight, self.variance_epsilon)
            return fused.view(*hidden_states.shape[:-2], *self.weight.shape)
        return super().forward(hidden_states)


class SpecFormerRotaryEmbedding(nn.Module):
    """Rotary tables of the context attention, built from the target's RoPE parameters (copied into the config)."""

    def __init__(self, config: SpecFormerConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies `[head_dim / 2]` (float32) and the attention scaling of the configured RoPE type."""
        rope_type = (self.config.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default":
            return ROPE_INIT_FUNCTIONS[rope_type](self.config)
        base = (self.config.rope_parameters or {}).get("rope_theta", 10000.0)
        dim = self.config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[B, T]` -> cos, sin `[B, T, head_dim]` in x's dtype."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q `[B, H, T, hd]`, k `[B, KV, T, hd]`, cos/sin `[B, T, hd]` -> rotated q, k."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class SpecFormerSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), bias-free, as in the target's MLP."""

    def __init__(self, config: SpecFormerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, KV, S, hd]` -> `[B, KV * n_rep, S, hd]` (grouped-query attention)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: q `[B, H, T, hd]`, k/v `[B, KV, S, hd]`, additive mask `[B, 1, T, S]` -> `[B, T, H, hd]`.

    Softmax runs in float32.
    """
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class SpecFormerAttention(nn.Module):
    """Multi-head attention (GQA, bias-free), used twice.

    - context attention (`is_causal=True`): over the context positions, with RoPE, an explicit causal+padding mask
      and its own KV cache (layer 0 of the drafter's `Cache`);
    - slot attention (`is_causal=False`): across the l_d draft slots of one position, no mask, no RoPE, no cache.
    """

    def __init__(self, config: SpecFormerConfig, is_causal: bool):
        super().__init__()
        self.config = config
        self.layer_idx = 0
        self.is_causal = is_causal
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Cache | None = None) -> torch.Tensor:
        """hidden_states `[N, S, d]` -> `[N, S, d]`."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [N, H, S, hd]
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [N, KV, S, hd]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if position_embeddings is not None:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *position_embeddings)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                              eager_attention_forward)
        attn_output, _ = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,  # the context mask is always explicit; the slot attention is bidirectional
        )
        return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())


class SpecFormerNextTokenInput(nn.Module):
    """`config.next_token_input`: W_E . RMSNorm(e), e the target's embedding of x_{t+1}; W_E starts at zero (so a
    drafter trained without it drafts the same until fine-tuned)."""

    def __init__(self, config: SpecFormerConfig):
        super().__init__()
        self.norm = SpecFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.weight = nn.Parameter(torch.zeros(config.hidden_size, config.hidden_size))  # W_E, d -> d

    def forward(self, next_token_embeds: torch.Tensor) -> torch.Tensor:
        """`[B, T, d]` -> `[B, T, d]`."""
        return nn.functional.linear(self.norm(next_token_embeds), self.weight)


class SpecFormerContextBlock(nn.Module):
    """Eq. 8: I_D = (MSA . RMS + I)(W_D . I_Cat), the drafter's "layer L+1" over the context (no FFN after it)."""

    def __init__(self, config: SpecFormerConfig):
        super().__init__()
        self.hooked_norm = SpecFormerGroupedRMSNorm(NUM_HOOKED_STATES, config.hidden_size, eps=config.rms_norm_eps)
        self.down_proj = nn.Linear(NUM_HOOKED_STATES * config.hidden_size, config.hidden_size, bias=False)
        self.next_token_input = SpecFormerNextTokenInput(config) if config.next_token_input else None
        self.input_layernorm = SpecFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SpecFormerAttention(config, is_causal=True)

    def forward(self, hooked_states, position_embeddings, attention_mask, past_key_values,
                next_token_embeds=None) -> torch.Tensor:
        """hooked_states `[B, T, 4, d]` (and next_token_embeds `[B, T, d]` with `next_token_input`) -> `[B, T, d]`."""
        fused = self.down_proj(self.hooked_norm(hooked_states).flatten(-2))  # [B, T, 4d] -> [B, T, d]
        if self.next_token_input is not None:
            fused = fused + self.next_token_input(next_token_embeds)
        attended = self.self_attn(self.input_layernorm(fused), position_embeddings, attention_mask, past_key_values)
        return fused + attended


class SpecFormerSlotBlock(nn.Module):
    """Eqs. 9-10: positional FFN into l_d slots, then a pre-norm encoder block across the slots."""

    def __init__(self, config: SpecFormerConfig):
        super().__init__()
        self.draft_length = config.draft_length
        self.positional_layernorm = SpecFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.positional_proj = nn.Linear(config.hidden_size, config.draft_length * config.hidden_size, bias=True)
        self.input_layernorm = SpecFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SpecFormerAttention(config, is_causal=False)
        self.post_attention_layernorm = SpecFormerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SpecFormerSwiGLU(config)

    def forward(self, context_states: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """context_states `[B, P, d]` -> slot states `[B, P, k, d]`."""
        batch, positions, hidden = context_states.shape
        slots = self.positional_proj(self.positional_layernorm(context_states))  # [B, P, l_d * d]
        slots = slots.view(batch * positions, self.draft_length, hidden)  # [B*P, l_d, d]
        slots = slots + self.self_attn(self.input_layernorm(slots))
        slots = slots[:, :num_draft_tokens]  # all l_d slots attend; only the first k continue
        slots = slots + self.mlp(self.post_attention_layernorm(slots))
        return slots.view(batch, positions, num_draft_tokens, hidden)


@dataclass
class SpecFormerOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor` of shape `[B, P, k, V]`, *optional*): draft logits at the positions asked for;
            slot j at position t scores token x_{t+2+j}. `None` with `return_logits=False`.
        slot_hidden_states (`torch.FloatTensor` of shape `[B, P, k, d]`): slot states before the target's final
            norm (what training detaches for intra-batch gradient accumulation).
        cache (`Cache`, *optional*): the context attention's cache, grown by T positions (transformers 5.24's name
            for `past_key_values`).
    """

    logits: torch.FloatTensor | None = None
    slot_hidden_states: torch.FloatTensor | None = None
    cache: Cache | None = None


class SpecFormerPreTrainedModel(PreTrainedModel):
    config: SpecFormerConfig
    base_model_prefix = "specformer"
    _no_split_modules = ["SpecFormerContextBlock", "SpecFormerSlotBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    save_hooks: ClassVar[list[Callable[[PreTrainedModel, str | os.PathLike], None]]] = []
    """Called as `hook(model, save_directory)` after `save_pretrained` (so also `push_to_hub`) wrote a folder on the
    main process. The hf_specformer package registers `hub.export.complete_hub_folder` (a drafter's
    `custom_generate/`, a model card where there is none); remote code alone writes weights, config and code."""

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            for hook in self.save_hooks:
                hook(self, save_directory)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, SpecFormerRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, SpecFormerNextTokenInput):
            init.zeros_(module.weight)
        elif isinstance(module, SpecFormerRotaryEmbedding):  # non-persistent: rebuilt after meta-device loading
            init.copy_(module.inv_freq, module.compute_inv_freq()[0])
        elif isinstance(module, SpecFormerForDrafting) and module.draft_vocab_ids is not None:
            init.copy_(module.draft_vocab_ids, torch.arange(module.draft_vocab_ids.numel()))  # placeholder ids


class SpecFormerForDrafting(SpecFormerPreTrainedModel):
    """SpecFormer drafter. Bind it to its target (`bind_target`) before asking for logits.

    Example:
        >>> draft = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config)).bind_target(target)
        >>> out = target(input_ids, output_hidden_states=True)
        >>> hooked = draft.select_hooked_states(out.hidden_states)          # 4 x [B, T, d]
        >>> draft(hooked).logits.shape                                      # [B, 1, k, V]
        >>> # with config.next_token_input, also pass next_token_ids [B, T]: the token after each position
    """

    def __init__(self, config: SpecFormerConfig):
        super().__init__(config)
        self.rotary_emb = SpecFormerRotaryEmbedding(config)
        self.context_block = SpecFormerContextBlock(config)
        self.slot_block = SpecFormerSlotBlock(config)
        draft_vocab_ids = None if config.draft_vocab_size is None else torch.arange(config.draft_vocab_size)
        self.register_buffer("draft_vocab_ids", draft_vocab_ids, persistent=True)  # [V_d] or None
        self._target_head: tuple[nn.Module, nn.Module] | None = None  # (final norm, lm_head); never saved
        self._target_embeddings: tuple[nn.Module] | None = None  # (input embeddings,): a tuple, so never saved
        self._draft_head: tuple[tuple, nn.Linear] | None = None  # (key, draft_head()) cache
        self.post_init()

    # ----- binding to the target -------------------------------------------------------------------------------
    def bind_target(self, target: PreTrainedModel, strict: bool = True) -> "SpecFormerForDrafting":
        """Shares the target's final norm and lm_head, and its input embeddings (not copied, not saved) after
        checking the target matches.

        Raises `ValueError` when hidden size, vocabulary size or layer count differ from the config, or (with
        `strict`) when the target's `model_type` differs from the one the drafter was built for.
        """
        target_config = target.config.get_text_config()
        expected = {
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "num_hidden_layers": self.config.num_target_layers,
        }
        found = {name: getattr(target_config, name, None) for name in expected}
        if strict and self.config.target_model_type not in (None, target_config.model_type):
            found["model_type"], expected["model_type"] = target_config.model_type, self.config.target_model_type
        mismatched = {name: (expected[name], found[name]) for name in expected if expected[name] != found[name]}
        if mismatched:
            details = ", ".join(f"{name}: drafter {want} vs target {got}" for name, (want, got) in mismatched.items())
            raise ValueError(
                f"This SpecFormer drafter was built for {self.config.target_name_or_path or 'another target'} and "
                f"does not match the target it is bound to ({details}). Use a drafter trained for this target."
            )
        lm_head = target.get_output_embeddings()
        final_norm = getattr(target.get_decoder(), "norm", None)
        if lm_head is None or final_norm is None:
            raise ValueError(f"{type(target).__name__} has no final `norm` and `lm_head` for the drafter to share.")
        self._target_head = (final_norm, lm_head)
        self._target_embeddings = (target.get_input_embeddings(),)
        return self

    @property
    def is_bound(self) -> bool:
        """Whether `bind_target` has attached a target's final norm and lm_head."""
        return self._target_head is not None

    def is_bound_to(self, target: PreTrainedModel) -> bool:
        """Whether this drafter shares `target`'s lm_head (i.e. was bound to that very model)."""
        return self._target_head is not None and self._target_head[1] is target.get_output_embeddings()

    def select_hooked_states(self, all_hidden_states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Picks `config.hook_layers` out of a target's `output_hidden_states` tuple (L + 1 tensors `[B, T, d]`)."""
        if len(all_hidden_states) != self.config.num_target_layers + 1:
            raise ValueError(
                f"Expected the target's {self.config.num_target_layers + 1} hidden states (embeddings + "
                f"{self.config.num_target_layers} layers), got {len(all_hidden_states)}."
            )
        return tuple(all_hidden_states[index] for index in self.config.hook_layers)

    def _bound_head(self) -> tuple[nn.Module, nn.Module]:
        """The target's (final norm, lm_head); raises if `bind_target` has not been called."""
        if self._target_head is None:
            raise RuntimeError("Call `draft.bind_target(target)` before computing draft logits.")
        return self._target_head

    def normalize(self, slot_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's final norm: `[..., d]` -> `[..., d]` in the target's dtype, the space of the target's own
        last hidden state (`output_hidden_states[-1]`) that its lm_head reads."""
        final_norm, lm_head = self._bound_head()
        return final_norm(slot_hidden_states.to(lm_head.weight.dtype))

    def compute_logits(self, slot_hidden_states: torch.Tensor) -> torch.Tensor:
        """Target final norm then the target's whole lm_head: `[..., d]` -> `[..., V]` in the target's dtype (what
        training scores; drafting goes through `draft_logits`)."""
        return self.head_logits(self.normalize(slot_hidden_states))

    def head_logits(self, normalized: torch.Tensor) -> torch.Tensor:
        """The target's whole lm_head on states already in its space (`normalize`'s output, or the target's own
        last hidden state): `[..., d]` -> `[..., V]`."""
        lm_head = self._bound_head()[1]
        return lm_head(normalized.to(lm_head.weight.dtype))

    def draft_logits(self, slot_hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft logits `[..., d]` -> `[..., V]`: `compute_logits`, or with a draft vocabulary only its V_d rows of
        the lm_head (`draft_head`), every other token at -inf."""
        if self.draft_vocab_ids is None:
            return self.compute_logits(slot_hidden_states)
        scores = self.draft_vocab_logits(slot_hidden_states)
        logits = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(logits.ndim - 1, self.draft_vocab_ids, scores)

    def draft_vocab_logits(self, slot_hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of the draft vocabulary alone: `[..., d]` -> `[..., V_d]` (column i scores `draft_vocab_ids[i]`;
        the whole `[..., V]` without a draft vocabulary), the target's final norm then `draft_head`."""
        return self.draft_head()(self.normalize(slot_hidden_states))

    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor | None) -> "SpecFormerForDrafting":
        """Restricts drafting to `token_ids` (saved with the weights; sets `config.draft_vocab_size`), or lifts the
        restriction with None. Raises `ValueError` for ids outside the vocabulary or duplicates."""
        if token_ids is None:
            self.draft_vocab_ids, self.config.draft_vocab_size = None, None
            return self
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        in_range = ids.numel() > 0 and 0 <= ids.min() and ids.max() < self.config.vocab_size
        if not in_range or ids.unique().numel() != ids.numel():
            raise ValueError(f"A draft vocabulary needs distinct token ids in [0, {self.config.vocab_size}).")
        self.draft_vocab_ids = ids.to(self.device)
        self.config.draft_vocab_size = ids.numel()
        return self

    def draft_head(self) -> nn.Module:
        """The layer that scores draft tokens: the target's lm_head, or with a draft vocabulary an `nn.Linear` `d ->
        V_d` of its rows, gathered once and reused until the ids or the head change (not a submodule: never saved)."""
        lm_head = self._bound_head()[1]
        ids = self.draft_vocab_ids
        if ids is None:
            return lm_head
        key = (lm_head.weight.data_ptr(), lm_head.weight._version, ids.data_ptr(), ids._version, ids.numel())
        if self._draft_head is None or self._draft_head[0] != key:
            bias = getattr(lm_head, "bias", None)
            head = nn.Linear(lm_head.weight.shape[1], ids.numel(), bias=bias is not None, device="meta")
            with torch.inference_mode(False):  # built during generation, it may serve training later
                head.weight = nn.Parameter(lm_head.weight[ids], requires_grad=False)
                if bias is not None:
                    head.bias = nn.Parameter(bias[ids], requires_grad=False)
            self._draft_head = (key, head)
        return self._draft_head[1]

    # ----- forward ---------------------------------------------------------------------------------------------
    def forward(self, hooked_states: Sequence[torch.Tensor] | torch.Tensor,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool = True,
                draft_positions: torch.LongTensor | None = None, num_draft_tokens: int | None = None,
                return_logits: bool = True, next_token_ids: torch.LongTensor | None = None) -> SpecFormerOutput:
        r"""
        Args:
            hooked_states: the 4 hooked target states of the T new positions, a sequence of 4 tensors `[B, T, d]`
                (see `select_hooked_states`) or one tensor `[B, T, 4, d]`.
            position_ids (`[B, T]`, *optional*): RoPE positions; default: cache length + 0..T-1.
            attention_mask (`[B, S + T]`, *optional*): 1 for real context entries, 0 for padding or rejected
                drafts already in the cache (S = cache length). Default: all ones.
            past_key_values (`Cache`, *optional*): the context attention's cache; created when `use_cache`.
            draft_positions (`[B, P]`, *optional*): indices in 0..T-1 where to draft; default: the last one (P = 1).
                With P = 0 only the context stage runs (its cache grows) and `logits`/`slot_hidden_states` are None.
            num_draft_tokens (`int`, *optional*): k <= l_d; default `config.num_speculative_tokens`.
            return_logits: compute logits (needs `bind_target`); with False only `slot_hidden_states` are returned.
            next_token_ids (`[B, T]`, *optional*): x_{t+1} for each new position t: the token that follows it (for
                a drafting position, the token the target committed after it). Required with
                `config.next_token_input` (and `bind_target`), ignored otherwise.
        """
        hooked_states = self._stack_hooked_states(hooked_states)  # [B, T, 4, d]
        batch, new_positions = hooked_states.shape[:2]
        num_draft_tokens = self._check_num_draft_tokens(num_draft_tokens)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + new_positions, device=hooked_states.device)
            position_ids = position_ids.expand(batch, -1)
        if draft_positions is None:
            draft_positions = torch.full((batch, 1), new_positions - 1, device=hooked_states.device)
        elif draft_positions.ndim != 2 or draft_positions.shape[0] != batch:
            raise ValueError(f"`draft_positions` must be [B={batch}, P], got {tuple(draft_positions.shape)}.")

        mask = self._context_attention_mask(attention_mask, batch, past_length, new_positions, hooked_states)
        position_embeddings = self.rotary_emb(hooked_states, position_ids)
        next_token_embeds = self._embed_next_tokens(next_token_ids, hooked_states)
        context_states = self.context_block(hooked_states, position_embeddings, mask, past_key_values,
                                            next_token_embeds)  # [B, T, d]
        if draft_positions.shape[1] == 0:  # context only: the cache grows, nothing is drafted
            return SpecFormerOutput(cache=past_key_values)
        index = draft_positions[..., None].expand(-1, -1, context_states.shape[-1])
        slot_states = self.slot_block(torch.gather(context_states, 1, index), num_draft_tokens)  # [B, P, k, d]
        logits = self.draft_logits(slot_states) if return_logits else None
        return SpecFormerOutput(logits=logits, slot_hidden_states=slot_states, cache=past_key_values)

    def _stack_hooked_states(self, hooked_states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Validates and stacks the hooked states into `[B, T, 4, d]` in the drafter's dtype."""
        if isinstance(hooked_states, torch.Tensor):
            if hooked_states.ndim != 4 or hooked_states.shape[2] != NUM_HOOKED_STATES:
                raise ValueError(f"Expected hooked states [B, T, 4, d], got {tuple(hooked_states.shape)}.")
            stacked = hooked_states
        else:
            if len(hooked_states) != NUM_HOOKED_STATES:
                raise ValueError(
                    f"SpecFormer reads exactly {NUM_HOOKED_STATES} hooked target states (config.hook_layers = "
                    f"{self.config.hook_layers}), got {len(hooked_states)}."
                )
            stacked = torch.stack(tuple(hooked_states), dim=2)
        if stacked.shape[-1] != self.config.hidden_size:
            raise ValueError(f"Hooked states have width {stacked.shape[-1]}, expected {self.config.hidden_size}.")
        return stacked.to(self.dtype)

    def _embed_next_tokens(self, next_token_ids: torch.LongTensor | None, hooked_states: torch.Tensor):
        """The target's embeddings `[B, T, d]` of next_token_ids, with `config.next_token_input`; else None."""
        if not self.config.next_token_input:
            return None
        if next_token_ids is None or next_token_ids.shape != hooked_states.shape[:2]:
            shape = None if next_token_ids is None else tuple(next_token_ids.shape)
            raise ValueError(
                f"This drafter reads the token after each position (config.next_token_input): pass "
                f"`next_token_ids` [B, T] = {tuple(hooked_states.shape[:2])}, got {shape}."
            )
        if self._target_embeddings is None:
            raise RuntimeError("Call `draft.bind_target(target)` before running a drafter with `next_token_input`.")
        return self._target_embeddings[0](next_token_ids).to(self.dtype)

    def _check_num_draft_tokens(self, num_draft_tokens: int | None) -> int:
        k = self.config.num_speculative_tokens if num_draft_tokens is None else int(num_draft_tokens)
        if not 1 <= k <= self.config.draft_length:
            raise ValueError(
                f"num_draft_tokens k={k} must be between 1 and the drafter's l_d={self.config.draft_length} slots."
            )
        return k

    @staticmethod
    def _context_attention_mask(attention_mask, batch, past_length, new_positions, reference) -> torch.Tensor:
        """Additive mask `[B, 1, T, S + T]`: causal in cache order, minus padded/rejected keys; a query always sees
        itself, so fully padded rows stay finite."""
        total = past_length + new_positions
        device = reference.device
        keys = torch.arange(total, device=device)
        queries = torch.arange(past_length, total, device=device)
        allowed = keys[None, :] <= queries[:, None]  # [T, S + T]
        allowed = allowed[None].expand(batch, -1, -1)
        if attention_mask is not None:
            if attention_mask.shape != (batch, total):
                raise ValueError(f"attention_mask must be [B, S + T] = [{batch}, {total}], got {attention_mask.shape}.")
            allowed = allowed & attention_mask[:, None, :].bool()
        allowed = allowed | (keys[None, None, :] == queries[None, :, None])
        mask = torch.zeros(allowed.shape, dtype=reference.dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(reference.dtype).min)[:, None]


__all__ = ["SpecFormerPreTrainedModel", "SpecFormerForDrafting", "SpecFormerOutput"]
