"""Model configuration: one frozen dataclass whose knobs cover every GPT variant jaxgpt builds.

The config is validated when it is constructed, so a bad value fails at the command line
with a message that says what to change, not deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgpt.errors import UserError

POSITIONS = ("learned", "sinusoidal", "sinusoidal_concat", "none")
NORM_PLACEMENTS = ("pre", "post")
NORMS = ("layernorm", "unbiased_std")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
INITS = ("gpt2", "xavier")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("einsum", "xla", "cudnn")
REMATS = ("none", "full", "save_dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architectural choice of a decoder-only transformer, with GPT-2 defaults.

    Defaults are GPT-2 small except the sizes, which are tiny so that a bare
    `ModelConfig()` is cheap in tests.
    """

    # Sizes.
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    head_dim: int | None = None  # per-head size D; None -> n_embd // n_head (seed 004 sets its own)
    d_ff: int | None = None  # feed-forward width F; None -> 4 * n_embd
    # Positions and embeddings.
    position: str = "learned"
    pad_positions: bool = False  # seed 001: real tokens at positions 1..T, padding at 0
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(n_embd) (seed 000, 002)
    pad_id: int | None = None  # tokens equal to this id are padding: masked as keys
    # Normalization.
    norm_placement: str = "pre"
    final_norm: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    # Feed-forward, biases, output head.
    activation: str = "gelu_tanh"
    use_bias: bool = True
    tie_embeddings: bool = True
    # Dropout: embeddings, attention probabilities, sublayer outputs, inside the feed-forward.
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    ff_dropout: float = 0.0
    # Initialization, numerics, performance.
    init: str = "gpt2"
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    attention_impl: str = "einsum"
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.n_head > 0 and self.n_embd % self.n_head:
                raise UserError(
                    f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                    "change one of them or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.n_embd // max(self.n_head, 1))
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.n_embd)
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_dim", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{name}={value!r} must be a positive integer")
        choices = {
            "position": POSITIONS,
            "norm_placement": NORM_PLACEMENTS,
            "norm": NORMS,
            "activation": ACTIVATIONS,
            "init": INITS,
            "dtype": DTYPES,
            "param_dtype": DTYPES,
            "attention_impl": ATTENTION_IMPLS,
            "remat": REMATS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"model.{name}={getattr(self, name)!r} is unknown: choose one of {allowed}")
        for name in ("embd_dropout", "attn_dropout", "resid_dropout", "ff_dropout"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise UserError(f"model.{name}={rate} must be in [0, 1)")
        if self.norm_eps <= 0:
            raise UserError(f"model.norm_eps={self.norm_eps} must be positive")
        if self.position.startswith("sinusoidal") and self.n_embd % 2:
            raise UserError(f"sinusoidal positions need an even n_embd, got {self.n_embd}")
        if self.attention_impl != "einsum" and self.attn_dropout > 0:
            raise UserError(f"attention_impl={self.attention_impl!r} has no attention-probability dropout: "
                            "set attn_dropout=0 or use attention_impl='einsum'")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise UserError(f"model.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def n_positions(self) -> int:
        """Rows of the position table: one extra when position 0 is reserved for padding."""
        return self.block_size + int(self.pad_positions)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed; derived sizes follow new sizes unless given."""
        fields = self.to_dict()
        if self.head_dim == self.n_embd // self.n_head:
            fields["head_dim"] = None
        if self.d_ff == 4 * self.n_embd:
            fields["d_ff"] = None
        return ModelConfig(**{**fields, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Build a config from a plain dict (a checkpoint's or a config file's), rejecting unknown keys."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown model config keys {unknown}: valid keys are {sorted(known)}")
    return ModelConfig(**values)
