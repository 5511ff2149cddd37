"""SpecFormer drafter configuration.

SpecFormer (Shi et al., "Scaling LLM Speculative Decoding: Non-Autoregressive Forecasting in Large-Batch
Scenarios", AAAI-26, arXiv 2511.20340) is a small module on a frozen target's hidden states. Its attention
dimensions are the target's, so the configuration is derived from the target's with `from_target_config`.

This file is shipped to the Hub as remote code: it imports only `transformers`.
"""

from transformers import PreTrainedConfig


class SpecFormerConfig(PreTrainedConfig):
    r"""
    Configuration of [`SpecFormerForDrafting`]. Build it from a target with [`SpecFormerConfig.from_target_config`].

    Args:
        hidden_size (`int`): the target's hidden size d; SpecFormer works at the same width.
        intermediate_size (`int`): width of the slot SwiGLU (the target's MLP width).
        num_attention_heads (`int`): query heads of both attentions (the target's).
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); defaults to
            `num_attention_heads`.
        head_dim (`int`, *optional*): per-head width; defaults to `hidden_size // num_attention_heads`.
        rms_norm_eps (`float`): epsilon of every RMSNorm (the target's).
        rope_parameters (`dict`, *optional*): RoPE type and theta of the context attention (the target's).
        max_position_embeddings (`int`): longest position the rotary tables are sized for (the target's).
        vocab_size (`int`): the target's vocabulary; the drafter has no embedding or head of its own, this is
            only checked when binding to a target.
        draft_length (`int`): l_d, the number of draft slots the positional FFN produces (paper: 8).
        num_speculative_tokens (`int`, *optional*): default k, drafts proposed per step (k <= l_d); defaults to
            `min(4, draft_length)`, the paper's benchmark setting.
        hook_layers (`list[int]`, *optional*): four indices into the target's `output_hidden_states` tuple
            (index 0 = embedding output, index L = the post-final-norm last state). Defaults to the paper's
            HS[0], HS[L/2], HS[L-1], HS[L], i.e. `[0, L // 2, L - 1, L]`.
        num_target_layers (`int`): L, the target's number of decoder layers.
        target_model_type (`str`, *optional*): `model_type` of the target the drafter was built for.
        target_architecture (`str`, *optional*): class name of that target (e.g. `LlamaForCausalLM`).
        target_name_or_path (`str`, *optional*): where that target came from, for model cards and error messages.
        draft_vocab_size (`int`, *optional*): V_d: drafts only from the `draft_vocab_ids` buffer's tokens, so the
            head reads V_d rows of the lm_head (as EAGLE-3 and FR-Spec); verification still uses all V. None: all.
        next_token_input (`bool`): an extension, not in the paper: position t also reads the embedding of x_{t+1}
            (at drafting time the token the target just committed), as EAGLE does; its projection starts at zero.
        acceptance_table (`dict`, *optional*): confidence per slot -> P(accept), from `hf-specformer calibrate`.
        attention_dropout (`float`): dropout on attention probabilities during training.
        initializer_range (`float`): std of the normal init of linear weights.
    """

    model_type = "specformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    draft_length: int = 8
    num_speculative_tokens: int | None = None
    hook_layers: list[int] | None = None
    num_target_layers: int = 30
    target_model_type: str | None = None
    target_architecture: str | None = None
    target_name_or_path: str | None = None
    draft_vocab_size: int | None = None
    next_token_input: bool = False
    acceptance_table: dict | None = None
    attention_dropout: float = 0.0
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(4, self.draft_length)
        if self.hook_layers is None:
            layers = self.num_target_layers
            self.hook_layers = [0, layers // 2, layers - 1, layers]
        self.hook_layers = [int(index) % (self.num_target_layers + 1) for index in self.hook_layers]
        super().__post_init__(**kwargs)
        self._check_values()

    def _check_values(self) -> None:
        """Raises `ValueError` naming the bad field and what would fix it."""
        if self.draft_length < 1:
            raise ValueError(f"`draft_length` (l_d) must be >= 1, got {self.draft_length}.")
        if not 1 <= self.num_speculative_tokens <= self.draft_length:
            raise ValueError(
                f"`num_speculative_tokens` ({self.num_speculative_tokens}) must be between 1 and "
                f"`draft_length` ({self.draft_length})."
            )
        if len(self.hook_layers) != 4:
            raise ValueError(
                f"`hook_layers` must name exactly 4 target hidden states (paper: HS[0], HS[L/2], HS[L-1], HS[L]), "
                f"got {len(self.hook_layers)}: {self.hook_layers}."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`draft_vocab_size` ({self.draft_vocab_size}) must be between 1 and `vocab_size` ({self.vocab_size})."
            )
        if self.hidden_size < 1 or self.head_dim < 1 or self.num_target_layers < 1:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}), `head_dim` ({self.head_dim}) and `num_target_layers` "
                f"({self.num_target_layers}) must be positive."
            )

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, draft_length: int = 8,
                           hook_layers: list[int] | None = None, **kwargs) -> "SpecFormerConfig":
        """Derives a drafter configuration from a target's (Llama, Qwen2, Qwen3, Mistral, ...).

        Copies hidden size, heads, KV heads, head dim, RoPE parameters, RMS eps, intermediate size and vocab size;
        records the target's type, architecture and name so that binding to another target fails loudly.
        """
        text_config = target_config.get_text_config()
        missing = [
            name
            for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
            if getattr(text_config, name, None) is None
        ]
        if missing:
            raise ValueError(
                f"The target config ({type(text_config).__name__}) lacks {missing}; SpecFormer needs a decoder-only "
                "target with a final norm, an lm_head and rotary embeddings (Llama, Qwen2, Qwen3, Mistral, ...)."
            )
        architectures = getattr(target_config, "architectures", None) or []
        return cls(hidden_size=text_config.hidden_size, intermediate_size=text_config.intermediate_size,
                   num_attention_heads=text_config.num_attention_heads,
                   num_key_value_heads=getattr(text_config, "num_key_value_heads", None),
                   head_dim=getattr(text_config, "head_dim", None),
                   rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
                   rope_parameters=dict(getattr(text_config, "rope_parameters", None) or {}) or None,
                   max_position_embeddings=getattr(text_config, "max_position_embeddings", 8192),
                   vocab_size=text_config.vocab_size, num_target_layers=text_config.num_hidden_layers,
                   draft_length=draft_length, hook_layers=hook_layers, target_model_type=text_config.model_type,
                   target_architecture=architectures[0] if architectures else None,
                   target_name_or_path=getattr(target_config, "_name_or_path", None) or None, **kwargs)


__all__ = ["SpecFormerConfig"]
