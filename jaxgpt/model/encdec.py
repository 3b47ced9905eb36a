"""The encoder-decoder Transformer (seed 002's Keras model, the Annotated Transformer's full model) in Flax.

Shapes are named in variable suffixes: B batch, S source length, T target length, C n_embd, H heads,
D head_dim, V target vocabulary.

The encoder reads the whole source at once (no causal mask); each decoder layer attends causally to the
target prefix, then to the encoder's output ("memory", B x S x C), then applies the feed-forward. Training
feeds the target shifted right (teacher forcing), so position t predicts target t + 1 from targets <= t.
Projections, norms and the MLP are `jaxgpt.model.layers`; every attention goes through `jaxgpt.model.attention.attend`,
and the decoder's self-attention is the GPT's own `CausalSelfAttention`, so both stacks shard by the same
logical axis names as the GPT.

Padding: tokens equal to `pad_id`, or masked out by an explicit mask (True = real token), are hidden as
keys: source padding from the encoder's self-attention and from every cross-attention, target padding
from the decoder's self-attention (where, as in the GPT, every query still sees itself). Each source row
needs at least one real token: cross-attention has nothing else to look at.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.errors import UserError
from jaxgpt.model.attention import Cache, CausalSelfAttention
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.gpt import sinusoidal_table
from jaxgpt.model.layers import MLP, EinsumDense, Norm, param_init
from jaxgpt.ops.attention import attend

Array = jax.Array


class Attention(nn.Module):
    """Multi-head attention whose keys are not a causal subset: the encoder's, and cross-attention.

    Self-attention (no `memory_BSC`) fuses its three projections into one (C, 3, H, D) kernel, the GPT's
    layout. Cross-attention projects queries (C, H, D) from the decoder stream and keys and values with one
    (C, 2, H, D) kernel from the memory, which decoding can then compute once per source. `attend` runs with
    causal=False: its causal shortcuts (skipped upper triangle, splash) would drop visible keys here.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, memory_BSC: Array | None, visible_BTS: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        fused_names, fused_bias = ("embed", None, "heads", "head_dim"), (None, "heads", "head_dim")
        if memory_BSC is None:
            qkv = EinsumDense(cfg, "btc,ckhd->btkhd", (C, 3, H, D), fused_names, fused_bias, fans=(C, H * D),
                              name="qkv")(x_BTC)
            q_BTHD, k_BSHD, v_BSHD = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q_BTHD = EinsumDense(cfg, "btc,chd->bthd", (C, H, D), ("embed", "heads", "head_dim"),
                                 ("heads", "head_dim"), fans=(C, H * D), name="q")(x_BTC)
            kv = EinsumDense(cfg, "bsc,ckhd->bskhd", (C, 2, H, D), fused_names, fused_bias, fans=(C, H * D),
                             name="kv")(memory_BSC)
            k_BSHD, v_BSHD = kv[:, :, 0], kv[:, :, 1]
        drop = nn.Dropout(cfg.attn_dropout)
        y, probs, _ = attend(q_BTHD, k_BSHD.transpose(0, 2, 1, 3), v_BSHD.transpose(0, 2, 1, 3), visible_BTS,
                             impl=cfg.attention_impl, dtype=cfg.dtype, causal=False,
                             dropout=lambda p: drop(p, deterministic=deterministic))
        if probs is not None:
            self.sow("intermediates", "attn_weights", probs)  # dropped unless asked for
        return EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",),
                           residual=True, fans=(H * D, C), name="out")(y)


def sublayer(cfg: ModelConfig, x_BTC: Array, f: Callable[[Array], Array], norm: Norm, deterministic: bool,
             is_attention: bool = False) -> Array:
    """One residual sub-layer: x + drop(f(norm(x))) pre-norm (seed 000), norm(x + drop(f(x))) post-norm (seed 002).

    An attention sub-layer's output skips the dropout unless attn_resid_dropout (seed 002's Keras layers drop
    only the feed-forward's).
    """
    drop = nn.Dropout(cfg.resid_dropout if cfg.attn_resid_dropout or not is_attention else 0.0)
    if cfg.norm_placement == "pre":
        return x_BTC + drop(f(norm(x_BTC)), deterministic=deterministic)
    return norm(x_BTC + drop(f(x_BTC), deterministic=deterministic))


class EncoderBlock(nn.Module):
    """Self-attention over the whole source, then the feed-forward: the GPT block without its causal mask."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BSC: Array, visible_BSS: Array, deterministic: bool) -> Array:
        cfg = self.cfg
        attn, mlp = Attention(cfg, name="attn"), MLP(cfg, name="mlp")
        x_BSC = sublayer(cfg, x_BSC, lambda h: attn(h, None, visible_BSS, deterministic), Norm(cfg, name="ln_1"),
                         deterministic, is_attention=True)
        x_BSC = sublayer(cfg, x_BSC, lambda h: mlp(h, deterministic), Norm(cfg, name="ln_2"), deterministic)
        return nn.with_logical_constraint(x_BSC, ("batch", "length", "act_embed"))


class DecoderBlock(nn.Module):
    """Causal self-attention (ln_1), cross-attention on the memory (ln_2), feed-forward (ln_3)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, memory_BSC: Array, visible_BTT: Array, visible_BTS: Array,
                 deterministic: bool) -> Array:
        cfg = self.cfg
        attn, cross, mlp = CausalSelfAttention(cfg, name="attn"), Attention(cfg, name="cross"), MLP(cfg, name="mlp")
        x_BTC = sublayer(cfg, x_BTC, lambda h: attn(h, visible_BTT, deterministic)[0], Norm(cfg, name="ln_1"),
                         deterministic, is_attention=True)
        x_BTC = sublayer(cfg, x_BTC, lambda h: cross(h, memory_BSC, visible_BTS, deterministic),
                         Norm(cfg, name="ln_2"), deterministic, is_attention=True)
        x_BTC = sublayer(cfg, x_BTC, lambda h: mlp(h, deterministic), Norm(cfg, name="ln_3"), deterministic)
        return nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed"))


class CrossAttentionStep(nn.Module):
    """`Attention`'s cross-attention parameters (q, kv, out), split for decoding into two calls.

    `memory_kv` projects the memory into keys and values once per source; `__call__` attends new
    queries to them. Applied to a decoder layer's `cross` parameters it computes what `Attention` does.
    """

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
        self.q = EinsumDense(cfg, "btc,chd->bthd", (C, H, D), ("embed", "heads", "head_dim"), ("heads", "head_dim"),
                             fans=(C, H * D))
        self.kv = EinsumDense(cfg, "bsc,ckhd->bskhd", (C, 2, H, D), ("embed", None, "heads", "head_dim"),
                              (None, "heads", "head_dim"), fans=(C, H * D))
        self.out = EinsumDense(cfg, "bthd,hdc->btc", (H, D, C), ("heads", "head_dim", "embed"), ("embed",),
                               residual=True, fans=(H * D, C))

    def memory_kv(self, memory_BSC: Array) -> tuple[Array, Array]:
        """Head-major keys and values (B, H, S, D) of the memory."""
        kv = self.kv(memory_BSC)
        return kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)

    def __call__(self, x_BTC: Array, k_BHSD: Array, v_BHSD: Array, visible_BTS: Array) -> Array:
        cfg = self.cfg
        y_BTHD, _, _ = attend(self.q(x_BTC), k_BHSD, v_BHSD, visible_BTS, impl=cfg.attention_impl, dtype=cfg.dtype,
                              causal=False)
        return self.out(y_BTHD)


class DecoderBlockStep(nn.Module):
    """`DecoderBlock` for generation: new tokens against a self-attention KV cache and precomputed cross K/V.

    DecoderBlock's single compact `__call__` projects the memory again on every call; a decoder emitting
    one token at a time needs that once per source (`CrossAttentionStep.memory_kv`). This module gives its
    parts DecoderBlock's names, so it runs on a `dec_i` parameter subtree unchanged (`EncoderDecoder.decode_step`
    binds it).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, cache: Cache, cache_index: Array, kv: tuple[Array, Array], visible_BTS: Array,
                 cross_visible_BTS: Array) -> tuple[Array, Cache]:
        cfg = self.cfg
        attn, cross = CausalSelfAttention(cfg, name="attn"), CrossAttentionStep(cfg, name="cross")
        mlp = MLP(cfg, name="mlp")
        written = {}

        def self_attention(h_BTC: Array) -> Array:
            y_BTC, written["cache"] = attn(h_BTC, visible_BTS, True, cache, cache_index)
            return y_BTC

        x_BTC = sublayer(cfg, x_BTC, self_attention, Norm(cfg, name="ln_1"), True)
        x_BTC = sublayer(cfg, x_BTC, lambda h: cross(h, *kv, cross_visible_BTS), Norm(cfg, name="ln_2"), True)
        x_BTC = sublayer(cfg, x_BTC, lambda h: mlp(h, True), Norm(cfg, name="ln_3"), True)
        return x_BTC, written["cache"]


class EncoderDecoder(nn.Module):
    """Source tokens (B, S) and shifted target tokens (B, T) -> next-target-token logits (B, T, V) in float32.

    Parameters: `wte` the target's token table (also the source's with share_embeddings, else `src_wte`),
    `wpe` / `src_wpe` learned positions, `enc_i` / `dec_i` the layers, `enc_ln_f` / `ln_f` the final norms
    (final_norm), `lm_head` the output projection unless tie_embeddings reuses `wte`.
    """

    cfg: Seq2SeqConfig

    def setup(self) -> None:
        cfg, mc = self.cfg, self.cfg.model
        embed = lambda rows, names, role: nn.Embed(rows, mc.n_embd, dtype=mc.dtype, param_dtype=mc.param_dtype,
                                                   embedding_init=param_init(mc, names, role=role))
        self.wte = embed(mc.vocab_size, ("vocab", "embed"), "token")
        self.src_wte = self.wte if cfg.share_embeddings else embed(cfg.src_vocab_size, ("vocab", "embed"), "token")
        if mc.position == "learned":
            self.wpe = embed(mc.block_size, ("position", "embed"), "position")
            self.src_wpe = embed(cfg.src_block_size, ("position", "embed"), "position")
        self.drop = nn.Dropout(mc.embd_dropout)
        self.encoder = [EncoderBlock(mc, name=f"enc_{i}") for i in range(cfg.n_encoder_layer)]
        self.decoder = [DecoderBlock(mc, name=f"dec_{i}") for i in range(mc.n_layer)]
        if mc.final_norm:
            self.enc_ln_f, self.ln_f = Norm(mc), Norm(mc)
        if not mc.tie_embeddings:
            self.lm_head = EinsumDense(mc, "btc,cv->btv", (mc.n_embd, mc.vocab_size), ("embed", "vocab"), ("vocab",),
                                       role="head")

    def _embed(self, table: nn.Embed, positions: nn.Embed | None, idx_BT: Array, limit: int,
               deterministic: bool) -> Array:
        """Token embeddings (times sqrt(C) with scale_embeddings) plus positions 0..T-1; dropout on the sum, or
        on the tokens alone (embd_dropout_site="tokens")."""
        mc = self.cfg.model
        T = idx_BT.shape[1]
        if limit < T:
            raise UserError(f"a sequence of {T} tokens is longer than the model's {limit}: raise block_size "
                            "(targets) or src_block_size (sources)")
        tokens_only = mc.embd_dropout_site == "tokens"
        x_BTC = table(idx_BT)
        if mc.scale_embeddings:
            x_BTC = x_BTC * math.sqrt(mc.n_embd)
        if tokens_only:
            x_BTC = self.drop(x_BTC, deterministic=deterministic)
        if positions is not None:
            x_BTC = x_BTC + positions(jnp.arange(T))[None]
        elif mc.position != "none":
            x_BTC = x_BTC + jnp.asarray(sinusoidal_table(T, mc.n_embd, mc.position), mc.dtype)[None]
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed"))
        return x_BTC if tokens_only else self.drop(x_BTC, deterministic=deterministic)

    def _real(self, idx_BT: Array, mask_BT: Array | None) -> Array:
        """True at real tokens: not the pad id, and not masked out by `mask_BT` (True = real)."""
        pad_id = self.cfg.model.pad_id
        real_BT = jnp.ones(idx_BT.shape, bool) if pad_id is None else idx_BT != pad_id
        return real_BT if mask_BT is None else real_BT & mask_BT.astype(bool)

    def source_mask(self, src_BS: Array, src_mask_BS: Array | None = None) -> Array:
        """The (B, S) mask `decode` takes: True at real source tokens."""
        return self._real(src_BS, src_mask_BS)

    def encode(self, src_BS: Array, src_mask_BS: Array | None = None, deterministic: bool = True) -> Array:
        """The memory (B, S, C): every source position sees every real source token."""
        S = src_BS.shape[1]
        visible_BSS = jnp.broadcast_to(self.source_mask(src_BS, src_mask_BS)[:, None, :], (src_BS.shape[0], S, S))
        x_BSC = self._embed(self.src_wte, getattr(self, "src_wpe", None), src_BS, self.cfg.src_block_size,
                            deterministic)
        for block in self.encoder:
            x_BSC = block(x_BSC, visible_BSS, deterministic)
        return self.enc_ln_f(x_BSC) if self.cfg.model.final_norm else x_BSC

    def decode(self, tgt_BT: Array, memory_BSC: Array, src_mask_BS: Array, tgt_mask_BT: Array | None = None,
               deterministic: bool = True) -> Array:
        """Logits (B, T, V) for the targets after each of tgt_BT's prefixes, given the memory.

        `src_mask_BS` is `source_mask`'s: the memory alone does not say which of its rows are padding.
        """
        B, T = tgt_BT.shape
        real_BT = self._real(tgt_BT, tgt_mask_BT)
        causal_1TT = jnp.tril(jnp.ones((1, T, T), bool))
        visible_BTT = causal_1TT & (real_BT[:, None, :] | jnp.eye(T, dtype=bool)[None])
        visible_BTS = jnp.broadcast_to(src_mask_BS.astype(bool)[:, None, :], (B, T, src_mask_BS.shape[1]))
        x_BTC = self._embed(self.wte, getattr(self, "wpe", None), tgt_BT, self.cfg.model.block_size, deterministic)
        for block in self.decoder:
            x_BTC = block(x_BTC, memory_BSC, visible_BTT, visible_BTS, deterministic)
        h_BTC = self.ln_f(x_BTC) if self.cfg.model.final_norm else x_BTC
        logits_BTV = self.wte.attend(h_BTC) if self.cfg.model.tie_embeddings else self.lm_head(h_BTC)
        return logits_BTV.astype(jnp.float32)

    def __call__(self, src_BS: Array, tgt_BT: Array, src_mask_BS: Array | None = None,
                 tgt_mask_BT: Array | None = None, deterministic: bool = True) -> Array:
        memory_BSC = self.encode(src_BS, src_mask_BS, deterministic)
        return self.decode(tgt_BT, memory_BSC, self.source_mask(src_BS, src_mask_BS), tgt_mask_BT, deterministic)


    def memory_kv(self, memory_BSC: Array) -> list[tuple[Array, Array]]:
        """Every decoder layer's cross-attention keys and values (B, H, S, D): all decoding needs of the memory."""
        params = self.variables["params"]
        return [CrossAttentionStep(self.cfg.model, parent=None).bind({"params": params[f"dec_{i}"]["cross"]})
                .memory_kv(memory_BSC) for i in range(self.cfg.model.n_layer)]

    def decode_step(self, tgt_BT: Array, cache: list[Cache], cache_index: Array, memory_kv: list[tuple[Array, Array]],
                    src_mask_BS: Array) -> tuple[Array, list[Cache]]:
        """Logits (B, T, V) of T new target tokens at positions cache_index.., and the updated cache.

        `decode` for generation, as `GPT.decode` is for the GPT: earlier tokens' self-attention keys and
        values come from `cache` (`attention.init_cache(cfg.model, B, length)`; slots past the new tokens
        are never visible), the cross-attention's from `memory_kv`. Targets are never padding here.
        """
        mc = self.cfg.model
        B, T = tgt_BT.shape
        q_pos_T = cache_index + jnp.arange(T)
        visible_1TS = (jnp.arange(cache[0]["k"].shape[-2])[None, :] <= q_pos_T[:, None])[None]
        cross_visible_BTS = jnp.broadcast_to(src_mask_BS.astype(bool)[:, None, :], (B, T, src_mask_BS.shape[1]))
        x_BTC = self.wte(tgt_BT)
        if mc.scale_embeddings:
            x_BTC = x_BTC * math.sqrt(mc.n_embd)
        if mc.position == "learned":
            x_BTC = x_BTC + self.wpe(q_pos_T)[None]
        elif mc.position != "none":
            table_LC = jnp.asarray(sinusoidal_table(mc.block_size, mc.n_embd, mc.position), mc.dtype)
            x_BTC = x_BTC + table_LC[q_pos_T][None]
        new_cache = []
        for i, kv in enumerate(memory_kv):
            x_BTC, layer_cache = self._step_block(i)(x_BTC, cache[i], cache_index, kv, visible_1TS, cross_visible_BTS)
            new_cache.append(layer_cache)
        h_BTC = self.ln_f(x_BTC) if mc.final_norm else x_BTC
        logits_BTV = self.wte.attend(h_BTC) if mc.tie_embeddings else self.lm_head(h_BTC)
        return logits_BTV.astype(jnp.float32), new_cache

    def _step_block(self, i: int) -> DecoderBlockStep:
        """Decoder layer i's parameters in their decoding form (a module created outside `setup`, bound to them)."""
        return DecoderBlockStep(self.cfg.model, parent=None).bind({"params": self.variables["params"][f"dec_{i}"]})


def dummy_batch(cfg: Seq2SeqConfig) -> tuple[Array, Array]:
    """The smallest (source, target) pair `init` needs: parameter shapes do not depend on it."""
    zeros = lambda length: jnp.zeros((1, min(length, 8)), jnp.int32)
    return zeros(cfg.src_block_size), zeros(cfg.model.block_size)


def init_params(cfg: Seq2SeqConfig, key: Array) -> dict:
    """Plain (unboxed) float parameters, built under jit."""
    return nn.unbox(jax.jit(EncoderDecoder(cfg).init)(key, *dummy_batch(cfg))["params"])


def abstract_variables(cfg: Seq2SeqConfig) -> dict:
    """`init`'s variables as boxed ShapeDtypeStructs: shapes and logical axis names, nothing allocated."""
    return jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), *dummy_batch(cfg))
