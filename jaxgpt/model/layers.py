"""The building blocks the models share: initializers with logical axis names, projections, norms, the MLP.

Shapes are named in variable suffixes: B batch, T length, C n_embd, H heads, D head_dim, F d_ff.
Every parameter carries logical axis names (`nn.with_logical_partitioning`); the table in
`jaxgpt.train.sharding` maps them onto a device mesh, so no module ever mentions devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.model import lora, quant
from jaxgpt.model.config import ModelConfig
from jaxgpt.ops import activation, projection

Array = jax.Array

ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    "relu2": lambda x: jnp.square(nn.relu(x)),
    "silu": nn.silu,
}


def _uniform(bound: float) -> nn.initializers.Initializer:
    def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def param_init(cfg: ModelConfig, names: tuple[str | None, ...], *, residual: bool = False,
               fans: tuple[int, int] | None = None, role: str = "attn") -> nn.initializers.Initializer:
    """Weight init with logical names, by `cfg.init` (the rules are listed at `config.INITS`).

    GPT-2 shrinks the residual projections by 1/sqrt(2 L) so the residual stream's variance
    does not grow with depth. Xavier and PyTorch's default bound 1/sqrt(fan_in) take (fan_in, fan_out)
    per projection when given, so the fused (C, 3, H, D) kernel gets the bounds of three separate
    (C, H*D) matrices. `role` ("attn", "mlp", "token", "position", "head", "classes") matters only to
    gpt1_torch: seed 001 initializes some modules explicitly and leaves the others at PyTorch's defaults.
    `zero_init_proj` starts the residual projections at zero, whatever the rule: each layer then begins as the
    identity and learns its update (modded-nanogpt).
    """
    if residual and cfg.zero_init_proj:
        init = nn.initializers.zeros
    elif cfg.init in ("xavier", "xavier_torch"):
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            fan_in, fan_out = fans or (shape[-2], shape[-1])
            return _uniform(math.sqrt(6.0 / (fan_in + fan_out)))(key, shape, dtype)
    elif cfg.init == "gpt1_torch" and role in ("attn", "head"):  # nn.Linear's kaiming_uniform(a=sqrt(5))
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            return _uniform(1.0 / math.sqrt((fans or shape[-2:])[0]))(key, shape, dtype)
    elif cfg.init == "gpt1_torch":  # explicit normal(0.02) inits; the position table keeps nn.Embedding's N(0, 1)
        init = nn.initializers.normal(1.0 if role == "position" else 0.02)
    else:
        init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
    return nn.with_logical_partitioning(init, names)


def bias_init(cfg: ModelConfig, names: tuple[str | None, ...], fan_in: int,
              role: str = "attn") -> nn.initializers.Initializer:
    """Projection biases: zero, except under the PyTorch inits, whose nn.Linear biases are U(+-1/sqrt(fan_in)).

    Seed 001's classifier head calls `normal_(bias, 0)`, which sets the mean and keeps the default std 1.
    """
    if cfg.init == "gpt1_torch" and role == "classes":
        init = nn.initializers.normal(1.0)
    elif cfg.init in ("xavier_torch", "gpt1_torch"):
        init = _uniform(1.0 / math.sqrt(fan_in))
    else:
        init = nn.initializers.zeros
    return nn.with_logical_partitioning(init, names)


def zeros_init(names: tuple[str | None, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


class Norm(nn.Module):
    """LayerNorm, seed 000's variant that divides by (unbiased std + eps), or RMSNorm, over the last axis.

    Statistics are computed in float32 whatever the compute dtype: bf16 means lose too much. The scale is
    learned unless norm_scale is off, and acts as (norm_scale_offset + w) (Gemma stores w around 0), its w starting
    where that is 1; the bias follows use_bias. QK-norm asks for RMSNorm without a bias (`kind`, `bias`), for the
    attention's work dtype (`out_dtype`) and, over a whole projection (qk_norm_site "projection"), for statistics
    and a scale over its last two axes (`names`).
    """

    cfg: ModelConfig
    kind: str | None = None  # None: the model's norm
    bias: bool = True  # a bias when the model has biases
    out_dtype: str | None = None  # None: the model's dtype
    names: tuple[str | None, ...] = ("norm",)  # the scale's logical axes: one per normalized (last) axis of x

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        kind = self.kind or cfg.norm
        axes = tuple(range(-len(self.names), 0))
        x32 = x.astype(jnp.float32)
        if kind == "rmsnorm":
            y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axes, keepdims=True) + cfg.norm_eps)
        elif kind == "layernorm":
            mean = x32.mean(-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + cfg.norm_eps)
        else:
            mean = x32.mean(-1, keepdims=True)
            y = (x32 - mean) / (jnp.std(x32, axis=-1, keepdims=True, ddof=1) + cfg.norm_eps)
        if cfg.norm_scale:
            offset = cfg.norm_scale_offset
            init = nn.initializers.ones if offset == 0 else nn.initializers.constant(1.0 - offset)
            scale = self.param("scale", nn.with_logical_partitioning(init, self.names), x.shape[-len(axes):],
                               cfg.param_dtype)
            y = y * scale if offset == 0 else y * (offset + scale.astype(jnp.float32))
        if cfg.use_bias and self.bias:
            y = y + self.param("bias", zeros_init(("norm",)), (x.shape[-1],), cfg.param_dtype)
        return y.astype(self.out_dtype or cfg.dtype)


class EinsumDense(nn.Module):
    """A projection with a multi-axis kernel: y = einsum(spec, x, kernel) + bias.

    Keeping heads as their own kernel axis lets the sharding rules split them (tensor parallelism)
    without reshapes, and the initializer sees the true shape (DenseGeneral flattens it). LoRA adapters found
    beside the kernel in `params` (`jaxgpt.model.lora.overlay` puts them there) add their low-rank products unmerged;
    a quantized kernel there (`jaxgpt.model.quant`, QLoRA's base) is dequantized inside the projection.
    """

    cfg: ModelConfig
    spec: str
    kernel_shape: tuple[int, ...]
    kernel_names: tuple[str | None, ...]
    bias_names: tuple[str | None, ...]
    residual: bool = False
    fans: tuple[int, int] | None = None
    role: str = "attn"  # for `param_init`
    out_dtype: str | None = None  # y's dtype (None: the model's); attention asks for its own, `attention.work_dtype`
    kernel_storage: str = projection.DECLARED  # how the kernel is stored: `jaxgpt.ops.projection` says why
    bias: bool | None = None  # None: the model's use_bias (the attention's q, k and v projections: qkv_bias)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        n_out = len(self.bias_names)  # the kernel's output axes, its last ones
        params = self.variables.get("params", {})
        quantized = "kernel_q" in params  # a QLoRA base's quantized kernel (`jaxgpt.model.quant`)
        if not quantized:  # created before the bias: the params rng's order
            init = param_init(cfg, self.kernel_names, residual=self.residual, fans=self.fans, role=self.role)
            kernel = self.param("kernel", projection.stored_init(init, self.kernel_shape, n_out, self.kernel_storage),
                                projection.stored_shape(self.kernel_shape, n_out, self.kernel_storage), cfg.param_dtype)
        bias = None
        if cfg.use_bias if self.bias is None else self.bias:
            fan_in = self.fans[0] if self.fans else math.prod(self.kernel_shape[:-n_out])
            bias = self.param("bias", bias_init(cfg, self.bias_names, fan_in), self.kernel_shape[-n_out:],
                              cfg.param_dtype)
        out_dtype = self.out_dtype or cfg.dtype
        if quantized:
            y = quant.project(self.spec, x, params["kernel_q"], params["kernel_scale"], bias,
                              kernel_shape=self.kernel_shape, dtype=cfg.dtype, out_dtype=out_dtype)
        else:
            y = projection.project(self.spec, x, kernel, bias, kernel_shape=self.kernel_shape, dtype=cfg.dtype,
                                   out_dtype=out_dtype, storage=self.kernel_storage)
        adapters = {k: v for k, v in params.items() if isinstance(v, Mapping) and "lora_a" in v}
        if not adapters:  # no adapter beside the kernel: the projection alone, as it always was
            return y
        return lora.project_adapters(self.spec, self.name, x, y, adapters, cfg.dtype)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> F -> C with the configured activation; gated (gated_mlp), the activation
    of a second projection `gate` multiplies `fc`'s output (SwiGLU, GeGLU)."""

    cfg: ModelConfig
    kernel_storage: str = projection.DECLARED

    @nn.compact
    def __call__(self, x_BTC: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        C, F = cfg.n_embd, cfg.d_ff
        fc = EinsumDense(cfg, "btc,cf->btf", (C, F), ("embed", "mlp"), ("mlp",), role="mlp",
                         kernel_storage=self.kernel_storage, name="fc")
        proj = EinsumDense(cfg, "btf,fc->btc", (F, C), ("mlp", "embed"), ("embed",), residual=True, role="mlp",
                           kernel_storage=self.kernel_storage, name="proj")
        # in float32, rounded once: a bf16 GELU rounds after each operation of its formula, which is both
        # less accurate and, on XLA:CPU, a slower pass (what the backward keeps of it: `activation.activate`)
        if cfg.gated_mlp:
            gate = EinsumDense(cfg, "btc,cf->btf", (C, F), ("embed", "mlp"), ("mlp",), role="mlp",
                               kernel_storage=self.kernel_storage, name="gate")
            h_BTF = activation.activate(ACTIVATIONS[cfg.activation], gate(x_BTC), cfg.dtype) * fc(x_BTC)
        else:
            h_BTF = activation.activate(ACTIVATIONS[cfg.activation], fc(x_BTC), cfg.dtype)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "act_mlp"))
        h_BTF = nn.Dropout(cfg.ff_dropout)(h_BTF, deterministic=deterministic)
        return proj(h_BTF)


def residual(cfg: ModelConfig, x_BTC: Array, f: Callable[[Array], Array], norm: Norm, deterministic: bool,
             is_attention: bool = False, post: Norm | None = None) -> Array:
    """One residual sub-layer: x + drop(f(norm(x))) pre-norm (GPT-2, seed 000), norm(x + drop(f(x))) post-norm;
    with a `post` norm (sandwich_norm) x + drop(post(f(norm(x)))) (Gemma 2, 3).

    An attention sub-layer's output skips the dropout unless attn_resid_dropout (seed 002's Keras layers drop
    only the feed-forward's). Call it from a compact module: the dropout is created where it acts.
    """
    if cfg.attn_resid_dropout or not is_attention:
        drop = lambda y: nn.Dropout(cfg.resid_dropout)(y, deterministic=deterministic)
    else:
        drop = lambda y: y
    if cfg.norm_placement == "pre":
        return x_BTC + drop(f(norm(x_BTC)) if post is None else post(f(norm(x_BTC))))
    return norm(x_BTC + drop(f(x_BTC)))


def sinusoidal_table(n_pos: int, dim: int, kind: str) -> np.ndarray:
    """Fixed position codes: seed 000 interleaves sin/cos per frequency, seed 002 concatenates them."""
    pos = np.arange(n_pos, dtype=np.float64)[:, None]
    half = dim // 2
    if kind == "sinusoidal":
        angle = pos * np.exp(-np.arange(0, dim, 2) * math.log(10000.0) / dim)
        table = np.zeros((n_pos, dim))
        table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
        return table
    angle = pos / 10000.0 ** (np.arange(half) / half)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)


class Embed(nn.Embed):
    """A table of rows (`nn.Embed`) that applies a LoRA adapter found beside it in `params` (`lora.overlay` puts the
    token table's there as "embed"): the lookup adds A[ids] (s B), and `attend` (a tied head) reads the adapted
    table too, both as if it were merged (E + s A B) but without copying the table."""

    def __call__(self, inputs: Array) -> Array:
        y = super().__call__(inputs)
        entry = self._adapter()
        return y if entry is None else y + lora.embed_adapter(inputs, entry, self.dtype).astype(y.dtype)

    def attend(self, query: Array) -> Array:
        """The query times the table's transpose, as one product contracting the table's rows in place: flax's
        `jnp.dot(query, table.T)` had XLA:CPU fuse a transposed copy of the table, and the final norm, into a
        loop of its own for batch-1 decoding's tied head (docs/benchmarks.md measures the difference)."""
        query, table = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        y = jax.lax.dot_general(query, table, (((query.ndim - 1,), (1,)), ((), ())))
        entry = self._adapter()
        return y if entry is None else y + lora.attend_adapter(query, entry, self.dtype).astype(y.dtype)

    def _adapter(self) -> Mapping[str, Any] | None:
        return self.variables.get("params", {}).get("embed")


def embedding_table(cfg: ModelConfig, rows: int, names: tuple[str, str], role: str) -> Embed:
    """A token or learned-position table (`role` "token" or "position", for `param_init`)."""
    return Embed(rows, cfg.n_embd, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                 embedding_init=param_init(cfg, names, role=role))


def embed(cfg: ModelConfig, tokens: nn.Embed, positions: nn.Embed | None, drop: nn.Dropout, idx_BT: Array,
          pos_BT: Array, n_positions: int, deterministic: bool) -> Array:
    """Token embeddings (times sqrt(C) with scale_embeddings) plus positions `pos_BT`: learned (`positions`),
    fixed (a sinusoidal table of `n_positions` rows) or none; embd_dropout on the sum, or (seed 001,
    embd_dropout_site="tokens") on the tokens alone. The GPT's and both stacks of the encoder-decoder."""
    tokens_only = cfg.embd_dropout_site == "tokens"
    x_BTC = tokens(idx_BT)
    if cfg.scale_embeddings:
        x_BTC = x_BTC * math.sqrt(cfg.n_embd)
    if tokens_only:
        x_BTC = drop(x_BTC, deterministic=deterministic)
    if positions is not None:
        x_BTC = x_BTC + positions(pos_BT)
    elif cfg.position != "none":
        x_BTC = x_BTC + jnp.asarray(sinusoidal_table(n_positions, cfg.n_embd, cfg.position), cfg.dtype)[pos_BT]
    x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed"))
    return x_BTC if tokens_only else drop(x_BTC, deterministic=deterministic)


def lm_head(cfg: ModelConfig, kernel_storage: str = projection.DECLARED) -> EinsumDense | None:
    """The output projection (C, V), or None when tie_embeddings reads the logits off the token table."""
    if cfg.tie_embeddings:
        return None
    return EinsumDense(cfg, "btc,cv->btv", (cfg.n_embd, cfg.vocab_size), ("embed", "vocab"), ("vocab",), role="head",
                       kernel_storage=kernel_storage)


def logits(tokens: nn.Embed, head: EinsumDense | None, h_BTC: Array, softcap: float | None = None) -> Array:
    """Float32 next-token logits (B, T, V) of hidden states: the untied head's, or the token table's transpose.

    `softcap` (logit_softcap) bounds them smoothly to (-cap, cap): cap * tanh(logits / cap).
    """
    logits_BTV = (tokens.attend(h_BTC) if head is None else head(h_BTC)).astype(jnp.float32)
    return logits_BTV if softcap is None else softcap * jnp.tanh(logits_BTV / softcap)


def rope_frequencies(cfg: ModelConfig, windowed: bool) -> tuple[Array, float]:
    """The rotary frequencies (D/2,) of a layer (float32) and the factor on their cos and sin (yarn's).

    A windowed layer with rope_local_theta rotates at that base, unscaled (Gemma 3's local layers); every other
    layer at rope_theta with rope_scaling, as transformers' `modeling_rope_utils` defines each kind.
    """
    half = cfg.head_dim // 2
    local = windowed and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    if local or cfg.rope_scaling is None:
        return theta ** (-jnp.arange(half, dtype=jnp.float32) / half), 1.0
    freq = theta ** (-np.arange(half, dtype=np.float64) / half)
    factor, factor_cos_sin = cfg.rope_factor, 1.0
    if cfg.rope_scaling == "linear":
        freq = freq / factor
    elif cfg.rope_scaling == "llama3":  # long wavelengths slowed by the factor, short kept, the band between blended
        wavelength = 2 * math.pi / freq
        original = cfg.rope_original_positions
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        freq = (1 - smooth) * freq / factor + smooth * freq
    else:  # yarn: interpolated below the beta_slow rotation count, original above beta_fast, a ramp between
        def dim_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
            return cfg.head_dim * math.log(cfg.rope_original_positions / (rotations * 2 * math.pi)) / (
                2 * math.log(cfg.rope_theta))
        lo = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
        hi = min(math.ceil(dim_of(cfg.rope_beta_slow)), cfg.head_dim - 1)
        ramp = np.clip((np.arange(half) - lo) / (hi - lo if hi != lo else 0.001), 0.0, 1.0)
        freq = freq / factor * ramp + freq * (1 - ramp)
        factor_cos_sin = cfg.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return jnp.asarray(freq, jnp.float32), factor_cos_sin


def rotary(x_BTHD: Array, pos_T: Array, freq_h: Array, factor: float | Array = 1.0) -> Array:
    """Rotary positions: each head's pair (i, i + D/2) rotated by the angle pos * freq_h[i] (`rope_frequencies`),
    in float32, cos and sin times `factor` (yarn's; 1 otherwise).

    The product of a rotated query and key then depends on their positions only through their distance.
    Returns x's dtype.
    """
    angle_TD = pos_T.astype(jnp.float32)[:, None] * freq_h
    cos, sin = jnp.cos(angle_TD)[:, None], jnp.sin(angle_TD)[:, None]  # (T, 1, D/2): every head alike
    if not (isinstance(factor, float) and factor == 1.0):
        cos, sin = cos * factor, sin * factor
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHD.dtype)
