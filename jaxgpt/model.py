"""The GPT family as Flax linen modules: pure functions through `init` / `apply`.

Shapes are named in variable suffixes: B batch, T query length, S key length (the cache
length when decoding), C n_embd, H heads, D head_dim, F d_ff, V vocab, L layers.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); the table in
`jaxgpt.sharding` maps them onto a device mesh, so the model never mentions devices.

Decoding uses an explicit key/value cache: `GPT.decode` takes the cache and the write
index and returns the new cache, so generation state is a plain pytree the caller owns.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig

Array = jax.Array
Cache = dict[str, Array]  # {"k": (B, H, S, D), "v": (B, H, S, D)}; stacked with a leading L when scanned

ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
}


def _init(cfg: ModelConfig, names: tuple[str | None, ...], *, residual: bool = False,
          fans: tuple[int, int] | None = None) -> nn.initializers.Initializer:
    """Weight init with logical names: GPT-2 normal(0.02) or seed 000's Xavier uniform.

    GPT-2 shrinks the residual projections by 1/sqrt(2 L) so the residual stream's variance
    does not grow with depth. Xavier takes (fan_in, fan_out) per projection when given, so the
    fused (C, 3, H, D) kernel gets the bounds of three separate (C, H*D) matrices.
    """
    if cfg.init == "xavier":
        def init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
            fan_in, fan_out = fans or (shape[-2], shape[-1])
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return jax.random.uniform(key, shape, dtype, -bound, bound)
    else:
        init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
    return nn.with_logical_partitioning(init, names)


def _zeros(names: tuple[str | None, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


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


class Norm(nn.Module):
    """LayerNorm, or seed 000's variant that divides by (unbiased std + eps).

    Statistics are computed in float32 whatever the compute dtype: bf16 means lose too much.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        if cfg.norm == "layernorm":
            y = (x32 - mean) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + cfg.norm_eps)
        else:
            y = (x32 - mean) / (jnp.std(x32, axis=-1, keepdims=True, ddof=1) + cfg.norm_eps)
        y = y * self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), cfg.param_dtype)
        if cfg.use_bias:
            y = y + self.param("bias", _zeros(("norm",)), (x.shape[-1],), cfg.param_dtype)
        return y.astype(cfg.dtype)


def einsum_in_kernel_order(spec: str, x: Array, kernel: Array) -> Array:
    """`jnp.einsum(spec, x, kernel)` for projections (every axis x shares with the kernel is contracted).

    jnp.einsum picks its own order for several contracted axes ("bthd,hdc->btc" contracts (d, h)), and
    XLA then transposes the kernel and the activations to match, on every call: in batch-1 decoding,
    that copy of each output-projection kernel added a sixth to the weight traffic. Contracting in the
    kernel's own axis order needs no copy.
    """
    inputs, out = spec.split("->")
    x_axes, k_axes = inputs.split(",")
    shared = [a for a in k_axes if a in x_axes]
    dims = ([x_axes.index(a) for a in shared], [k_axes.index(a) for a in shared])
    y = jax.lax.dot_general(x, kernel, (dims, ((), ())))
    y_axes = [a for a in x_axes + k_axes if a not in shared]
    return y.transpose([y_axes.index(a) for a in out])


def _ordering_zeros(x: Array) -> Array:
    """Zeros shaped like `x` that XLA can only get by computing `x` first (0 * x, NaN-safe).

    Added to a cache write, they order the write after the reads that produced `x`. With no data
    path from those reads to the write, XLA cannot prove the write comes last, and copies the cache
    (twice per layer and token) instead of updating it in place. Elementwise, so a sharded `x` needs
    no communication.
    """
    return jnp.nan_to_num(x * 0)


class EinsumDense(nn.Module):
    """A projection with a multi-axis kernel: y = einsum(spec, x, kernel) + bias.

    Keeping heads as their own kernel axis lets the sharding rules split them (tensor parallelism)
    without reshapes, and the initializer sees the true shape (DenseGeneral flattens it).
    """

    cfg: ModelConfig
    spec: str
    kernel_shape: tuple[int, ...]
    kernel_names: tuple[str | None, ...]
    bias_names: tuple[str | None, ...]
    residual: bool = False
    fans: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        kernel = self.param("kernel", _init(cfg, self.kernel_names, residual=self.residual, fans=self.fans),
                            self.kernel_shape, cfg.param_dtype)
        y = einsum_in_kernel_order(self.spec, x.astype(cfg.dtype), kernel.astype(cfg.dtype))
        if cfg.use_bias:
            bias_shape = self.kernel_shape[-len(self.bias_names):]
            y = y + self.param("bias", _zeros(self.bias_names), bias_shape, cfg.param_dtype).astype(cfg.dtype)
        return y


def query_blocks(T: int, S: int, causal: bool) -> list[tuple[int, int, int]]:
    """Row blocks (t0, t1, s1) of causal attention: queries t0..t1 need only keys 0..s1 = t1.

    Without a cache the visible keys are always a subset of the causal ones, so splitting the queries
    into blocks and giving each block only its prefix of keys skips the masked upper triangle: about
    40% of the attention FLOPs and of the (T, S) memory traffic, which dominates small models on CPUs.
    Blocks of max(64, T / 8) queries were the fastest of the sizes tried on a 2-core CPU (T = 256 and
    1024); the "one query block" row of benchmarks/bench_train.py shows the gain. Shorter or
    indivisible sequences, and decoding against a cache, use one block.
    """
    block = max(64, T // 8)
    n_blocks, ragged = divmod(T, block)
    if not causal or T != S or n_blocks < 2 or ragged:
        return [(0, T, S)]
    return [(t0, t0 + block, t0 + block) for t0 in range(0, T, block)]


def write_cache(cache: Cache, k_BHTD: Array, v_BHTD: Array, index: Array) -> Cache:
    """The cache with T new keys/values written at slots index..index+T-1 (in the cache's dtype)."""
    return {name: jax.lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype), index, 2)
            for name, new in (("k", k_BHTD), ("v", v_BHTD))}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention over visible keys, optionally reading/writing a KV cache."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, visible_BTS: Array, deterministic: bool,
                 cache: Cache | None = None, cache_index: Array | None = None) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        qkv = EinsumDense(cfg, "btc,ckhd->btkhd", (C, 3, H, D), ("embed", None, "heads", "head_dim"),
                          (None, "heads", "head_dim"), fans=(C, H * D), name="qkv")(x_BTC)
        q_BTHD = qkv[:, :, 0]
        # Keys/values head-major, (B, H, S, D): the layout both attention matmuls want, and the cache's.
        k_BHSD, v_BHSD = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
        if cache is not None and x_BTC.shape[1] == 1 and cfg.attention_impl == "einsum":
            return self._decode_one(q_BTHD, k_BHSD, v_BHSD, cache, cache_index)
        if cache is not None:  # write this step's keys/values at cache_index, attend over the whole cache
            cache = write_cache(cache, k_BHSD, v_BHSD, cache_index)
            k_BHSD, v_BHSD = cache["k"].astype(cfg.dtype), cache["v"].astype(cfg.dtype)

        if cfg.attention_impl == "einsum":
            q_BHTD = self._scaled_queries(q_BTHD)
            drop = nn.Dropout(cfg.attn_dropout)
            y_parts, probs_parts = [], []
            for t0, t1, s1 in query_blocks(T=x_BTC.shape[1], S=k_BHSD.shape[2], causal=cache is None):
                att_BHTS = jnp.einsum("bhtd,bhsd->bhts", q_BHTD[:, :, t0:t1], k_BHSD[:, :, :s1]).astype(jnp.float32)
                att_BHTS = jnp.where(visible_BTS[:, None, t0:t1, :s1], att_BHTS, jnp.finfo(jnp.float32).min)
                probs_BHTS = jax.nn.softmax(att_BHTS, axis=-1)
                probs_parts.append(jnp.pad(probs_BHTS, ((0, 0), (0, 0), (0, 0), (0, k_BHSD.shape[2] - s1))))
                probs_BHTS = drop(probs_BHTS, deterministic=deterministic)
                y_parts.append(jnp.einsum("bhts,bhsd->bhtd", probs_BHTS.astype(cfg.dtype), v_BHSD[:, :, :s1]))
            self.sow("intermediates", "attn_weights", jnp.concatenate(probs_parts, axis=2))  # dropped unless asked for
            y, out_spec = jnp.concatenate(y_parts, axis=2), "bhtd,hdc->btc"
        else:  # XLA's fused attention, or cuDNN's flash attention on GPUs; they take (B, S, H, D)
            y = jax.nn.dot_product_attention(
                q_BTHD, k_BHSD.transpose(0, 2, 1, 3), v_BHSD.transpose(0, 2, 1, 3), mask=visible_BTS[:, None],
                implementation=None if cfg.attention_impl == "xla" else "cudnn")
            out_spec = "bthd,hdc->btc"

        return self._out(y, out_spec), cache

    def _scaled_queries(self, q_BTHD: Array) -> Array:
        """Head-major queries times 1/sqrt(D): scaling the (T, D) queries costs less than the (T, S) scores."""
        scaled = q_BTHD.astype(jnp.float32) / math.sqrt(self.cfg.head_dim)
        return scaled.astype(self.cfg.dtype).transpose(0, 2, 1, 3)

    def _out(self, y: Array, spec: str) -> Array:
        cfg = self.cfg
        return EinsumDense(cfg, spec, (cfg.n_head, cfg.head_dim, cfg.n_embd), ("heads", "head_dim", "embed"),
                           ("embed",), residual=True, fans=(cfg.n_head * cfg.head_dim, cfg.n_embd), name="out")(y)

    def _decode_one(self, q_B1HD: Array, k_BH1D: Array, v_BH1D: Array, cache: Cache,
                    cache_index: Array) -> tuple[Array, Cache]:
        """One new token: attend over the cache as it was (slots < cache_index) plus the new key/value.

        The same keys and values as attending over the updated cache, but the updated cache is then
        only written, never read, and the write is ordered after the reads (`_ordering_zeros`), so XLA
        updates it in place; each copy of the cache it made otherwise cost as much as the attention.
        """
        cfg = self.cfg
        q_BH1D = self._scaled_queries(q_B1HD)
        old_BH1S = jnp.einsum("bhtd,bhsd->bhts", q_BH1D, cache["k"].astype(cfg.dtype)).astype(jnp.float32)
        old_BH1S = jnp.where(jnp.arange(old_BH1S.shape[-1]) < cache_index, old_BH1S, jnp.finfo(jnp.float32).min)
        self_BH11 = jnp.einsum("bhtd,bhtd->bht", q_BH1D, k_BH1D.astype(cfg.dtype)).astype(jnp.float32)[..., None]
        probs = jax.nn.softmax(jnp.concatenate([old_BH1S, self_BH11], axis=-1), axis=-1)
        y_BH1D = (jnp.einsum("bhts,bhsd->bhtd", probs[..., :-1].astype(cfg.dtype), cache["v"].astype(cfg.dtype))
                  + probs[..., -1:].astype(cfg.dtype) * v_BH1D.astype(cfg.dtype))
        zeros_BH1D = _ordering_zeros(y_BH1D)
        cache = write_cache(cache, k_BH1D + zeros_BH1D, v_BH1D + zeros_BH1D, cache_index)
        return self._out(y_BH1D, "bhtd,hdc->btc"), cache


class MLP(nn.Module):
    """Position-wise feed-forward: C -> F -> C with the configured activation."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        dense = lambda n, names, name, residual=False: nn.Dense(
            n, use_bias=cfg.use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name,
            kernel_init=_init(cfg, names, residual=residual), bias_init=_zeros(names[1:]))
        h_BTF = ACTIVATIONS[cfg.activation](dense(cfg.d_ff, ("embed", "mlp"), "fc")(x_BTC))
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "length", "act_mlp"))
        h_BTF = nn.Dropout(cfg.ff_dropout)(h_BTF, deterministic=deterministic)
        return dense(cfg.n_embd, ("mlp", "embed"), "proj", residual=True)(h_BTF)


class Block(nn.Module):
    """One transformer layer, pre-norm (GPT-2, seed 000) or post-norm (seeds 001, 004).

    The (carry, xs) -> (carry, ys) signature lets `nn.scan` stack it over layers: the
    residual stream is the carry and the per-layer cache is scanned.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, cache: Cache | None, visible_BTS: Array, cache_index: Array | None,
                 deterministic: bool) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        attn, mlp = CausalSelfAttention(cfg, name="attn"), MLP(cfg, name="mlp")
        ln_1, ln_2 = Norm(cfg, name="ln_1"), Norm(cfg, name="ln_2")
        drop = lambda y: nn.Dropout(cfg.resid_dropout)(y, deterministic=deterministic)
        if cfg.norm_placement == "pre":
            y, cache = attn(ln_1(x_BTC), visible_BTS, deterministic, cache, cache_index)
            x_BTC = x_BTC + drop(y)
            x_BTC = x_BTC + drop(mlp(ln_2(x_BTC), deterministic))
        else:
            y, cache = attn(x_BTC, visible_BTS, deterministic, cache, cache_index)
            x_BTC = ln_1(x_BTC + drop(y))
            x_BTC = ln_2(x_BTC + drop(mlp(x_BTC, deterministic)))
        return nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed")), cache


def _block_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.remat == "none":
        return Block
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "save_dots" else None
    # `deterministic` is a Python bool: it must be static (self=0, x=1, ..., deterministic=5).
    return nn.remat(Block, static_argnums=(5,), policy=policy, prevent_cse=not cfg.scan_layers)


class GPT(nn.Module):
    """Decoder-only language model: tokens (B, T) -> next-token logits (B, T, V) in float32."""

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        embed_init = _init(cfg, ("vocab", "embed"))
        self.wte = nn.Embed(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                            embedding_init=embed_init)
        if cfg.position == "learned":
            self.wpe = nn.Embed(cfg.n_positions, cfg.n_embd, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                embedding_init=_init(cfg, ("position", "embed")))
        self.drop = nn.Dropout(cfg.embd_dropout)
        block = _block_class(cfg)
        if cfg.scan_layers:
            self.h = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                             split_rngs={"params": True, "dropout": True},
                             in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.n_layer,
                             metadata_params={nn.PARTITION_NAME: "layers"})(cfg)
        else:
            self.blocks = [block(cfg, name=f"h_{i}") for i in range(cfg.n_layer)]
        if cfg.final_norm:
            self.ln_f = Norm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=cfg.use_bias, dtype=cfg.dtype,
                                    param_dtype=cfg.param_dtype, kernel_init=_init(cfg, ("embed", "vocab")),
                                    bias_init=_zeros(("vocab",)))

    def _is_pad(self, idx_BT: Array, mask_BT: Array | None) -> Array | None:
        """Padding from the config's pad_id, from an explicit mask (True = real token), or both."""
        pad = None if self.cfg.pad_id is None else idx_BT == self.cfg.pad_id
        if mask_BT is not None:
            pad = ~mask_BT if pad is None else pad | ~mask_BT
        return pad

    def _embed(self, idx_BT: Array, pos_BT: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        x_BTC = self.wte(idx_BT)
        if cfg.scale_embeddings:
            x_BTC = x_BTC * math.sqrt(cfg.n_embd)
        if cfg.position == "learned":
            x_BTC = x_BTC + self.wpe(pos_BT)
        elif cfg.position != "none":
            table = jnp.asarray(sinusoidal_table(cfg.n_positions, cfg.n_embd, cfg.position), cfg.dtype)
            x_BTC = x_BTC + table[pos_BT]
        return self.drop(x_BTC, deterministic=deterministic)

    def _layers(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                cache_index: Array | None = None) -> tuple[Array, Any]:
        if self.cfg.scan_layers:
            return self.h(x_BTC, cache, visible_BTS, cache_index, deterministic)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x_BTC, c = block(x_BTC, None if cache is None else cache[i], visible_BTS, cache_index, deterministic)
            new_cache.append(c)
        return x_BTC, new_cache

    def hidden(self, idx_BT: Array, mask_BT: Array | None = None, deterministic: bool = True) -> Array:
        """Final hidden states (B, T, C): after the final norm when the model has one."""
        T = idx_BT.shape[1]
        pos_BT = jnp.broadcast_to(jnp.arange(T), idx_BT.shape)
        visible_BTS = jnp.tril(jnp.ones((1, T, T), bool))
        pad_BT = self._is_pad(idx_BT, mask_BT)
        if self.cfg.pad_positions:
            pos_BT = pos_BT + 1 if pad_BT is None else jnp.where(pad_BT, 0, pos_BT + 1)
        if pad_BT is not None:  # a padding key is hidden, but every query still sees itself
            visible_BTS = (visible_BTS & ~pad_BT[:, None, :]) | jnp.eye(T, dtype=bool)[None]
        x_BTC = self._embed(idx_BT, pos_BT, deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed"))
        x_BTC, _ = self._layers(x_BTC, visible_BTS, deterministic)
        return self.ln_f(x_BTC) if self.cfg.final_norm else x_BTC

    def logits(self, h_BTC: Array) -> Array:
        logits_BTV = self.wte.attend(h_BTC) if self.cfg.tie_embeddings else self.lm_head(h_BTC)
        return logits_BTV.astype(jnp.float32)

    def __call__(self, idx_BT: Array, mask_BT: Array | None = None, deterministic: bool = True) -> Array:
        return self.logits(self.hidden(idx_BT, mask_BT, deterministic))

    def decode(self, idx_BT: Array, cache: Any, cache_index: Array, last_only: bool = False) -> tuple[Array, Any]:
        """Run T new tokens at positions cache_index.. against a cache of S = block_size slots.

        Used for both the prompt (prefill, T = prompt length) and each new token (T = 1).
        Returns float32 logits (B, T, V) (only the last position's, (B, 1, V), with `last_only`:
        a prefill needs no more) and the updated cache; slots past the written ones are never
        visible, so the cache may hold stale values there.
        """
        T = idx_BT.shape[1]
        S = (cache["k"] if self.cfg.scan_layers else cache[0]["k"]).shape[-2]
        q_pos_T = cache_index + jnp.arange(T)
        visible_BTS = (jnp.arange(S)[None, :] <= q_pos_T[:, None])[None]
        pos_BT = jnp.broadcast_to(q_pos_T + int(self.cfg.pad_positions), idx_BT.shape)
        x_BTC = self._embed(idx_BT, pos_BT, deterministic=True)
        x_BTC, cache = self._layers(x_BTC, visible_BTS, True, cache, cache_index)
        if last_only:
            x_BTC = x_BTC[:, -1:]
        h_BTC = self.ln_f(x_BTC) if self.cfg.final_norm else x_BTC
        return self.logits(h_BTC), cache


class GPTClassifier(GPT):
    """Seed 001's fine-tuning model: LM logits plus class logits read at the classification token.

    It extends GPT's parameter tree with `cls_head` only, so a language model checkpoint
    initializes it directly.
    """

    n_class: int = 2
    cls_token_id: int = 0
    cls_dropout: float = 0.1

    def setup(self) -> None:
        super().setup()
        self.cls_head = nn.Dense(self.n_class, dtype=self.cfg.dtype, param_dtype=self.cfg.param_dtype,
                                 kernel_init=_init(self.cfg, ("embed", "classes")), bias_init=_zeros(("classes",)))
        self.cls_drop = nn.Dropout(self.cls_dropout)

    def __call__(self, idx_BT: Array, mask_BT: Array | None = None,
                 deterministic: bool = True) -> tuple[Array, Array]:
        h_BTC = self.hidden(idx_BT, mask_BT, deterministic)
        T = idx_BT.shape[1]
        last_cls_B = T - 1 - jnp.argmax((idx_BT == self.cls_token_id)[:, ::-1], axis=1)
        h_BC = jnp.take_along_axis(h_BTC, last_cls_B[:, None, None], axis=1)[:, 0]
        cls_BK = self.cls_head(self.cls_drop(h_BC, deterministic=deterministic))
        return self.logits(h_BTC), cls_BK.astype(jnp.float32)


def init_cache(cfg: ModelConfig, batch_size: int, length: int | None = None, dtype: Any = None) -> Any:
    """Zeroed KV cache for `decode`: one (B, H, S, D) pair per layer, stacked when layers are scanned."""
    S = length or cfg.block_size
    dtype = dtype or cfg.dtype
    shape = (batch_size, cfg.n_head, S, cfg.head_dim)
    if cfg.scan_layers:
        shape = (cfg.n_layer, *shape)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layer)]


def dummy_tokens(cfg: ModelConfig) -> Array:
    """The smallest batch `init` needs: parameter shapes do not depend on it."""
    return jnp.zeros((1, min(cfg.block_size, 8)), jnp.int32)


def init_params(cfg: ModelConfig, key: Array, model: nn.Module | None = None) -> dict:
    """Plain (unboxed) float parameters, built under jit (eager init is slow to dispatch)."""
    model = model or GPT(cfg)
    return nn.unbox(jax.jit(model.init)(key, dummy_tokens(cfg))["params"])


def abstract_variables(cfg: ModelConfig, model: nn.Module | None = None) -> Any:
    """`init`'s variables as boxed ShapeDtypeStructs: shapes and logical axis names, nothing allocated."""
    return jax.eval_shape((model or GPT(cfg)).init, jax.random.key(0), dummy_tokens(cfg))


def param_partition_specs(cfg: ModelConfig, model: nn.Module | None = None) -> Any:
    """Logical PartitionSpecs of every parameter, from shapes only."""
    return nn.get_partition_spec(abstract_variables(cfg, model))["params"]


def unstack_layers(params: dict, n_layer: int) -> dict:
    """Scanned params (`h` with a leading L axis) -> one `h_i` subtree per layer."""
    out = {k: v for k, v in params.items() if k != "h"}
    for i in range(n_layer):
        out[f"h_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["h"])
    return out


def stack_layers(params: dict, n_layer: int) -> dict:
    """Inverse of `unstack_layers`: per-layer `h_i` subtrees -> scanned `h`."""
    out = {k: v for k, v in params.items() if not k.startswith("h_")}
    out["h"] = jax.tree.map(lambda *a: jnp.stack(a), *[params[f"h_{i}"] for i in range(n_layer)])
    return out
