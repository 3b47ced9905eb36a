"""Model configuration: one frozen dataclass whose knobs cover every GPT variant jaxgpt builds.

The config is validated when it is constructed, so a bad value fails at the command line
with a message that says what to change, not deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgpt.errors import UserError


def comma_names(text: str) -> tuple[str, ...]:
    """The names of a comma-separated setting ("q, k,,v" -> ("q", "k", "v")): the one parse of every config value
    that lists names (LoRA's targets and modules_to_save, the built-in datasets)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


POSITIONS = ("learned", "sinusoidal", "sinusoidal_concat", "none")
NORM_PLACEMENTS = ("pre", "post")
NORMS = ("layernorm", "unbiased_std", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "relu2", "silu")  # relu2: relu(x)^2 (modded-nanogpt, nanochat)
# gpt2: normal(0.02), residual projections / sqrt(2 L), zero biases. xavier: Xavier-uniform matrices, zero biases.
# xavier_torch: seed 000 (the Annotated Transformer), Xavier-uniform matrices with PyTorch's default Linear biases
# U(+-1/sqrt(fan_in)). gpt1_torch: seed 001, PyTorch's default Linear (weights and biases U(+-1/sqrt(fan_in))) in
# attention, normal(0.02) token table and feed-forward weights, normal(1) positions (nn.Embedding's default).
INITS = ("gpt2", "xavier", "xavier_torch", "gpt1_torch")
# Where embd_dropout acts: on tokens + positions (GPT-2, seed 000), or on the token embedding alone, before the
# positions are added (seed 001).
EMBD_DROPOUT_SITES = ("sum", "tokens")
DROPOUTS = ("embd_dropout", "attn_dropout", "resid_dropout", "ff_dropout")  # the rates, each in [0, 1)
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "splash", "auto")  # jaxgpt.model.attention.attend
REMATS = ("none", "full", "save_dots")
# Where qk_norm acts: per head over D after the rotary (nanochat), per head before it (Qwen3, Gemma 3), or over the
# whole H*D query and K*D key projections before it (OLMo 2).
QK_NORM_SITES = ("after_rope", "before_rope", "projection")
ROPE_SCALINGS = (None, "linear", "llama3", "yarn")  # transformers' rope_type names (`layers.rope_frequencies`)
# Settings that change neither parameter shapes nor their meaning: weights trained under one value load
# under any other (fine-tuning, sampling, export).
# The open-weight knobs (issue 62) that GPT-2's and NanoChat's formats have no place for (qkv_bias is checked apart:
# q/k/v biases equal to use_bias are GPT-2's own).
OPEN_WEIGHT_KNOBS = ("gated_mlp", "qk_norm_site", "norm_scale_offset", "sandwich_norm", "attn_softcap", "query_scale",
                     "sliding_window", "window_pattern", "rope_local_theta", "rope_scaling")
RUNTIME_FIELDS = frozenset({*DROPOUTS, "dtype", "param_dtype", "attention_impl", "scan_layers", "remat", "init",
                            "embd_dropout_site", "attn_resid_dropout", "zero_init_proj"})


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
    n_kv_head: int | None = None  # key/value heads K (grouped-query attention, 1 = multi-query); None -> n_head
    # Positions and embeddings.
    position: str = "learned"
    pad_positions: bool = False  # seed 001: real tokens at positions 1..T, padding at 0
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(n_embd) (seed 000, 002)
    pad_id: int | None = None  # tokens equal to this id are padding: masked as keys
    # Rotary positions (RoPE) of queries and keys with this base (nanochat: 100000); None or 0: off. They replace
    # position embeddings (position="none"). Each head's dimensions i and i + D/2 are the pair rotated by
    # position * base^(-2i/D) (the split-halves layout of GPT-NeoX and Llama in transformers).
    rope_theta: float | None = None
    # RoPE scaling for contexts past the pretrained one (`layers.rope_frequencies`): "linear" divides every
    # frequency by rope_factor; "llama3" divides the low ones (wavelength past rope_original_positions /
    # rope_low_freq_factor) and blends the middle band; "yarn" blends interpolated and original frequencies between
    # the rope_beta_fast and rope_beta_slow rotation counts and multiplies cos and sin by rope_attention_factor
    # (None: 0.1 ln(rope_factor) + 1).
    rope_scaling: str | None = None
    rope_factor: float = 1.0
    rope_original_positions: int | None = None  # llama3's and yarn's original_max_position_embeddings
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    # Normalization.
    norm_placement: str = "pre"
    final_norm: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_scale: bool = True  # the norms have a learned scale; False: parameter-free (nanochat's RMSNorm)
    embd_norm: bool = False  # a norm right after the embedding (nanochat), `ln_emb`
    # RMSNorm of each head's queries and keys over D, after the rotary (nanochat's order), with a learned (D,)
    # scale when norm_scale; never a bias. qk_norm_site moves it (QK_NORM_SITES): "projection" has (H, D) and (K, D)
    # scales.
    qk_norm: bool = False
    qk_norm_site: str = "after_rope"
    # Every norm's scale acts as (offset + w), its stored w starting at 1 - offset (Gemma: 1, w starting at 0).
    norm_scale_offset: float = 0.0
    # Each sub-layer's output normalized before the residual add, x + post(f(pre(x))) (Gemma 2, 3): `ln_1_post`,
    # `ln_2_post`.
    sandwich_norm: bool = False
    # Feed-forward, biases, output head.
    activation: str = "gelu_tanh"
    # A gated feed-forward: act(x W_gate) * (x W_fc), then W_proj (SwiGLU with silu, GeGLU with gelu_tanh: Llama,
    # Mistral, Qwen, Gemma). Its `gate` kernel is a second (C, F) matrix beside `fc`.
    gated_mlp: bool = False
    use_bias: bool = True
    qkv_bias: bool | None = None  # biases of the query, key and value projections only (Qwen2); None: use_bias
    tie_embeddings: bool = True
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (nanochat: 15); None: off
    # Attention. Scores -> cap * tanh(scores / cap) before the mask and softmax (Gemma 2); None: off.
    attn_softcap: float | None = None
    query_scale: float | None = None  # the factor on q.k; None: 1/sqrt(head_dim) (Gemma 3: query_pre_attn_scalar^-1/2)
    # A windowed layer's query at position i sees the keys j with i - sliding_window < j <= i (Mistral, Gemma).
    # window_pattern None: every layer windowed; N: layer i global when (i + 1) % N == 0 (Gemma 3: 6). Windowed
    # layers rotate with rope_local_theta (when set) and no rope_scaling; the others with rope_theta and scaling.
    sliding_window: int | None = None
    window_pattern: int | None = None
    rope_local_theta: float | None = None
    # Dropout: embeddings, attention probabilities, sublayer outputs, inside the feed-forward.
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    ff_dropout: float = 0.0
    embd_dropout_site: str = "sum"  # "sum": tokens + positions; "tokens": the token embedding only (seed 001)
    attn_resid_dropout: bool = True  # resid_dropout on attention outputs too; False: only after the feed-forward
    # Initialization, numerics, performance.
    init: str = "gpt2"
    zero_init_proj: bool = False  # the residual projections (attention out, MLP proj) start at zero (modded-nanogpt)
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    attention_impl: str = "einsum"
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self) -> None:
        if self.head_dim is None and self.n_head > 0 and self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                            "change one of them or set head_dim explicitly")
        for name, value in self._derived().items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.rope_theta == 0:  # one value for "off": configs compare equal, checkpoints say None
            object.__setattr__(self, "rope_theta", None)
        self._validate()
        self._validate_modern()

    def _derived(self) -> dict[str, int]:
        """The rule for sizes left unset (None): head_dim = n_embd / n_head, d_ff = 4 n_embd, n_kv_head = n_head."""
        return {"head_dim": self.n_embd // max(self.n_head, 1), "d_ff": 4 * self.n_embd, "n_kv_head": self.n_head}

    def is_derived(self, name: str) -> bool:
        """Whether `name` (head_dim, d_ff or n_kv_head) has the value the rule gives: it then follows the sizes."""
        return getattr(self, name) == self._derived()[name]

    def _validate(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_dim", "d_ff", "n_kv_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{name}={value!r} must be a positive integer")
        choices = {
            "position": POSITIONS,
            "norm_placement": NORM_PLACEMENTS,
            "norm": NORMS,
            "activation": ACTIVATIONS,
            "init": INITS,
            "embd_dropout_site": EMBD_DROPOUT_SITES,
            "dtype": DTYPES,
            "param_dtype": DTYPES,
            "attention_impl": ATTENTION_IMPLS,
            "remat": REMATS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"model.{name}={getattr(self, name)!r} is unknown: choose one of {allowed}")
        for name in DROPOUTS:
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise UserError(f"model.{name}={rate} must be in [0, 1)")
        if not isinstance(self.attn_resid_dropout, bool):
            raise UserError(f"model.attn_resid_dropout={self.attn_resid_dropout!r} must be True or False")
        if self.norm_eps <= 0:
            raise UserError(f"model.norm_eps={self.norm_eps} must be positive")
        if self.position.startswith("sinusoidal") and self.n_embd % 2:
            raise UserError(f"sinusoidal positions need an even n_embd, got {self.n_embd}")
        if self.attention_impl != "einsum" and self.attn_dropout > 0:
            raise UserError(f"attention_impl={self.attention_impl!r} has no attention-probability dropout: "
                            "set attn_dropout=0 or use attention_impl='einsum'")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise UserError(f"model.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_modern(self) -> None:
        """The 2026 options (issue 37): each alone, and the pairs that cannot go together, named by their keys."""
        for name in ("norm_scale", "embd_norm", "qk_norm", "zero_init_proj", "gated_mlp", "sandwich_norm"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"model.{name}={getattr(self, name)!r} must be True or False")
        if self.n_head % self.n_kv_head:
            raise UserError(f"model.n_head={self.n_head} is not a multiple of model.n_kv_head={self.n_kv_head}: "
                            "each key/value head serves a whole group of query heads")
        if self.rope_theta is not None:
            if self.rope_theta < 0:
                raise UserError(f"model.rope_theta={self.rope_theta} must be positive (or 0 / None: no rotary)")
            if self.head_dim % 2:
                raise UserError(f"model.rope_theta needs an even model.head_dim, got {self.head_dim}: "
                                "rotary positions rotate pairs of dimensions")
            if self.position != "none":
                raise UserError(f"model.rope_theta={self.rope_theta} with model.position={self.position!r}: "
                                "rotary positions replace position embeddings, set position='none'")
        for name in ("logit_softcap", "attn_softcap", "query_scale"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise UserError(f"model.{name}={getattr(self, name)} must be positive (None: off)")
        self._validate_open_weights()

    def _validate_open_weights(self) -> None:
        """The knobs of open-weight architectures (issue 62): Llama 3, Mistral, Qwen 2/3, Gemma 3, OLMo 2."""
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise UserError(f"model.qkv_bias={self.qkv_bias!r} must be True, False or None (follow use_bias)")
        if self.qk_norm_site not in QK_NORM_SITES:
            raise UserError(f"model.qk_norm_site={self.qk_norm_site!r} is unknown: choose one of {QK_NORM_SITES}")
        if self.sandwich_norm and self.norm_placement != "pre":
            raise UserError("model.sandwich_norm needs model.norm_placement='pre': it normalizes pre-norm sub-layers' "
                            "outputs")
        for name in ("sliding_window", "window_pattern", "rope_original_positions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise UserError(f"model.{name}={value!r} must be a positive integer (None: off)")
        if self.window_pattern is not None and self.sliding_window is None:
            raise UserError("model.window_pattern needs model.sliding_window: it says which layers are windowed")
        if self.rope_local_theta is not None and (self.sliding_window is None or not self.rotary
                                                  or not self.rope_local_theta > 0):
            raise UserError(f"model.rope_local_theta={self.rope_local_theta} needs rotary positions (rope_theta) and "
                            "windowed layers (sliding_window), and must be positive")
        self._validate_rope_scaling()
        impl = self.attention_impl
        if self.attn_softcap is not None and impl in ("xla", "cudnn", "splash"):
            raise UserError(f"model.attn_softcap with attention_impl={impl!r}: its kernels have no score soft-cap; "
                            "use attention_impl='einsum' or 'auto'")
        if self.sliding_window is not None and impl == "splash":
            raise UserError("model.sliding_window with attention_impl='splash': it has no window here; use "
                            "attention_impl='auto', 'xla' or 'einsum'")

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UserError(f"model.rope_scaling={self.rope_scaling!r} is unknown: choose one of {ROPE_SCALINGS}")
        if self.rope_scaling is None:
            return
        if not self.rotary:
            raise UserError(f"model.rope_scaling={self.rope_scaling!r} needs rotary positions: set model.rope_theta")
        if not self.rope_factor >= 1:
            raise UserError(f"model.rope_factor={self.rope_factor} must be at least 1")
        if self.rope_scaling in ("llama3", "yarn") and self.rope_original_positions is None:
            raise UserError(f"model.rope_scaling={self.rope_scaling!r} needs model.rope_original_positions (the "
                            "pretrained context, original_max_position_embeddings)")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                            f"{self.rope_high_freq_factor} must satisfy 0 < low < high")
        if self.rope_scaling == "yarn" and not 0 < self.rope_beta_slow <= self.rope_beta_fast:
            raise UserError(f"model.rope_beta_slow={self.rope_beta_slow} and rope_beta_fast={self.rope_beta_fast} "
                            "must satisfy 0 < slow <= fast")
        if self.rope_attention_factor is not None and not self.rope_attention_factor > 0:
            raise UserError(f"model.rope_attention_factor={self.rope_attention_factor} must be positive (None: "
                            "yarn's 0.1 ln(factor) + 1)")

    @property
    def any_dropout(self) -> bool:
        """Whether any dropout rate is non-zero: training then draws masks (a key per step); else it needs none."""
        return any(getattr(self, name) > 0 for name in DROPOUTS)

    @property
    def rotary(self) -> bool:
        return self.rope_theta is not None

    def changed(self, names: tuple[str, ...]) -> list[str]:
        """`name=value` of each of `names` that differs from ModelConfig's default: what an export format without
        those options cannot hold."""
        fields = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"{name}={getattr(self, name)!r}" for name in names if getattr(self, name) != fields[name]]

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases: qkv_bias, or use_bias when it is None."""
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

    def windowed_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its attention is windowed (sliding_window): every layer, or all but each
        window_pattern-th."""
        if self.sliding_window is None:
            return (False,) * self.n_layer
        pattern = self.window_pattern
        return tuple(pattern is None or (i + 1) % pattern != 0 for i in range(self.n_layer))

    @property
    def n_positions(self) -> int:
        """Rows of the position table: one extra when position 0 is reserved for padding."""
        return self.block_size + int(self.pad_positions)

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed; derived sizes follow new sizes unless given."""
        return ModelConfig(**{**self.settings(), **changes})

    def settings(self) -> dict[str, Any]:
        """The fields, with derived sizes as None (unset): what a config file or the command line changes."""
        return {**self.to_dict(), **{name: None for name in self._derived() if self.is_derived(name)}}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Build a config from a plain dict (a checkpoint's or a config file's), rejecting unknown keys."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown model config keys {unknown}: valid keys are {sorted(known)}")
    return ModelConfig(**values)


# Fields only an encoder-decoder has; every other choice is a ModelConfig field that both stacks share.
SEQ2SEQ_FIELDS = ("n_encoder_layer", "src_vocab_size", "src_block_size", "share_embeddings")


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
    """An encoder-decoder transformer: a ModelConfig for the decoder and the shared choices, plus the encoder's sizes.

    `model` says everything both stacks have in common (width, heads, norm and its placement, activation,
    positions, dropout, init, pad_id) and describes the decoder itself: n_layer decoder layers, vocab_size
    target tokens, block_size the longest target, tie_embeddings the output head sharing the target
    embedding. Composing rather than adding these four fields to ModelConfig keeps ModelConfig the
    description of one stack, which every GPT module, checkpoint and command reads, and lets the encoder
    reuse jaxgpt's layers unchanged.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    n_encoder_layer: int = 2
    src_vocab_size: int | None = None  # None -> the target vocabulary (model.vocab_size)
    src_block_size: int | None = None  # longest source; None -> model.block_size
    share_embeddings: bool = False  # one token table for source and target (needs equal vocabularies)

    def __post_init__(self) -> None:
        if self.src_vocab_size is None:
            object.__setattr__(self, "src_vocab_size", self.model.vocab_size)
        if self.src_block_size is None:
            object.__setattr__(self, "src_block_size", self.model.block_size)
        for name in ("n_encoder_layer", "src_vocab_size", "src_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{name}={value!r} must be a positive integer")
        if self.share_embeddings and self.src_vocab_size != self.model.vocab_size:
            raise UserError(f"share_embeddings needs one vocabulary: src_vocab_size={self.src_vocab_size} != "
                            f"vocab_size={self.model.vocab_size}")
        if self.model.pad_id is not None and self.model.pad_id >= self.src_vocab_size:
            raise UserError(f"model.pad_id={self.model.pad_id} is outside the source vocabulary "
                            f"[0, {self.src_vocab_size})")
        unsupported = {"scan_layers": False, "remat": "none", "pad_positions": False, "rope_theta": None,
                       "n_kv_head": self.model.n_head, "qk_norm": False, "embd_norm": False, "logit_softcap": None,
                       "qkv_bias": None, "norm_scale_offset": 0.0, "sandwich_norm": False, "attn_softcap": None,
                       "query_scale": None, "sliding_window": None}
        for name, plain in unsupported.items():
            if getattr(self.model, name) != plain:
                raise UserError(f"model.{name}={getattr(self.model, name)!r} is not available for the "
                                f"encoder-decoder: set {name}={plain!r}")

    def replace(self, **changes: Any) -> Seq2SeqConfig:
        """A validated copy; ModelConfig fields and the encoder's own fields may be mixed in `changes`.

        Source sizes equal to the target's follow them (as when derived), unless given.
        """
        own = {name: changes.pop(name) for name in SEQ2SEQ_FIELDS if name in changes}
        for name, target in (("src_vocab_size", "vocab_size"), ("src_block_size", "block_size")):
            if name not in own and getattr(self, name) == getattr(self.model, target):
                own[name] = None
        return dataclasses.replace(self, model=self.model.replace(**changes) if changes else self.model, **own)

    def to_dict(self) -> dict[str, Any]:
        """One flat dict: the ModelConfig fields and the encoder's."""
        return {**self.model.to_dict(), **{name: getattr(self, name) for name in SEQ2SEQ_FIELDS}}


def decoder_of(cfg: ModelConfig | Seq2SeqConfig) -> ModelConfig:
    """The config of the stack that decodes: a GPT's own, an encoder-decoder's `model` (whose block_size, vocabulary
    and KV cache are what generation, serving and sharding read)."""
    return cfg.model if isinstance(cfg, Seq2SeqConfig) else cfg
