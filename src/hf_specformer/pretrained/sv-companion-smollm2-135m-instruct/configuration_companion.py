"""Configuration of the Speculative Verification companion.

Speculative Verification (Kim et al., arXiv 2509.24328) scores each drafted position with a companion model's
distribution P_c; the signals S = overlap(P_draft, P_c) and A = min(1, P_c(d) / P_draft(d)) map through a calibrated
table to acceptance probabilities. Our companion is a small module on the frozen target's last hidden state (see
`modeling_companion.py`), so its configuration is derived from the target's with `from_target_config`.

This file is shipped to the Hub as remote code: it imports only `transformers`.
"""

from transformers import PreTrainedConfig


class CompanionConfig(PreTrainedConfig):
    r"""
    Configuration of [`CompanionForVerification`].

    Args:
        hidden_size (`int`): the target's hidden size d (what the companion reads and writes).
        companion_size (`int`): the companion's own width c (its block runs at c < d).
        num_attention_heads (`int`): heads of the chain attention (c must be a multiple).
        intermediate_size (`int`): width of its SwiGLU.
        max_chain_length (`int`): longest chain of drafted positions scored at once (k <= this).
        vocab_size (`int`): the target's vocabulary (checked when binding).
        companion_vocab_size (`int`, *optional*): V_c: P_c covers only the `vocab_ids` buffer's ids (the drafter's
            draft vocabulary, so S compares distributions over one support).
        rms_norm_eps (`float`): epsilon of its RMSNorms.
        target_model_type, target_architecture, target_name_or_path (`str`, *optional*): the target it was built
            for (binding to another fails loudly).
        acceptance_table (`dict`, *optional*): (S, A) -> P(accept), from `hf-specformer calibrate` (default P = A).
        initializer_range (`float`): std of the normal init of linear weights.
    """

    model_type = "sv_companion"

    hidden_size: int = 576
    companion_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 768
    max_chain_length: int = 8
    vocab_size: int = 49152
    companion_vocab_size: int | None = None
    rms_norm_eps: float = 1e-5
    target_model_type: str | None = None
    target_architecture: str | None = None
    target_name_or_path: str | None = None
    acceptance_table: dict | None = None
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.companion_size % self.num_attention_heads:
            raise ValueError(
                f"`companion_size` ({self.companion_size}) must be a multiple of `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.max_chain_length < 1:
            raise ValueError(f"`max_chain_length` must be >= 1, got {self.max_chain_length}.")
        if self.companion_vocab_size is not None and not 1 <= self.companion_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`companion_vocab_size` ({self.companion_vocab_size}) must be between 1 and `vocab_size` "
                f"({self.vocab_size})."
            )

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **kwargs) -> "CompanionConfig":
        """A companion configuration for a decoder-only target (Llama, Qwen2/3, Mistral, ...)."""
        text_config = target_config.get_text_config()
        architectures = getattr(target_config, "architectures", None) or []
        return cls(hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
                   rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6), target_model_type=text_config.model_type,
                   target_architecture=architectures[0] if architectures else None,
                   target_name_or_path=getattr(target_config, "_name_or_path", None) or None, **kwargs)


__all__ = ["CompanionConfig"]
