"""The seq2seq model (`Seq2SeqModel`), an encoder-decoder Transformer: seed 002's Keras model, the Annotated
Transformer's full model, in Flax.

Shapes are named in variable suffixes: B batch, S source length, T target length, C n_embd, H heads,
D head_dim, V target vocabulary.

The encoder reads the whole source at once (no causal mask); each decoder layer attends causally to the
target prefix, then to the encoder's output ("memory", B x S x C), then applies the feed-forward. Training
feeds the target shifted right (teacher forcing), so position t predicts target t + 1 from targets <= t.
It is built from the GPT's pieces: the embedding, the output head and the residual sub-layer
(`jaxgpt.model.layers`), the GPT's `Block` as the encoder layer (with every key visible), and one attention
module (`jaxgpt.model.attention.Attention`) for the decoder's causal self-attention and its cross-attention
over the memory, so both stacks shard by the same logical axis names as the GPT.

Padding: tokens equal to `pad_id`, or masked out by an explicit mask (True = real token), are hidden as
keys: source padding from the encoder's self-attention and from every cross-attention, target padding
from the decoder's self-attention (where, as in the GPT, every query still sees itself). Each source row
needs at least one real token: cross-attention has nothing else to look at.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.errors import UserError
from jaxgpt.model.attention import Attention, Cache
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.gpt import Block
from jaxgpt.model.layers import MLP, Norm, embed, embedding_table, lm_head, logits, residual

Array = jax.Array


class DecoderBlock(nn.Module):
    """Causal self-attention (ln_1), cross-attention on the memory (ln_2), feed-forward (ln_3).

    The memory is the encoder's output (B, S, C), or every layer's cross-attention keys and values
    (`Seq2SeqModel.memory_kv`) when generating, which also passes the self-attention's KV cache.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTC: Array, memory: Array | tuple[Array, Array], visible_BTT: Array, visible_BTS: Array,
                 deterministic: bool, cache: Cache | None = None, cache_index: Array | None = None
                 ) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        attn, cross = Attention(cfg, name="attn"), Attention(cfg, causal=False, cross=True, name="cross")
        mlp = MLP(cfg, name="mlp")
        written = {}

        def self_attention(h_BTC: Array) -> Array:
            y_BTC, written["cache"] = attn(h_BTC, visible_BTT, deterministic, cache, cache_index)
            return y_BTC

        x_BTC = residual(cfg, x_BTC, self_attention, Norm(cfg, name="ln_1"), deterministic, is_attention=True)
        x_BTC = residual(cfg, x_BTC, lambda h: cross(h, visible_BTS, deterministic, memory=memory)[0],
                         Norm(cfg, name="ln_2"), deterministic, is_attention=True)
        x_BTC = residual(cfg, x_BTC, lambda h: mlp(h, deterministic), Norm(cfg, name="ln_3"), deterministic)
        return nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed")), written["cache"]


class Seq2SeqModel(nn.Module):
    """Source tokens (B, S) and shifted target tokens (B, T) -> next-target-token logits (B, T, V) in float32.

    Parameters: `wte` the target's token table (also the source's with share_embeddings, else `src_wte`),
    `wpe` / `src_wpe` learned positions, `enc_i` / `dec_i` the layers, `enc_ln_f` / `ln_f` the final norms
    (final_norm), `lm_head` the output projection unless tie_embeddings reuses `wte`.
    """

    cfg: Seq2SeqConfig

    def setup(self) -> None:
        cfg, mc = self.cfg, self.cfg.model
        self.wte = embedding_table(mc, mc.vocab_size, ("vocab", "embed"), "token")
        self.src_wte = self.wte if cfg.share_embeddings else \
            embedding_table(mc, cfg.src_vocab_size, ("vocab", "embed"), "token")
        learned = mc.position == "learned"
        self.wpe = embedding_table(mc, mc.block_size, ("position", "embed"), "position") if learned else None
        self.src_wpe = embedding_table(mc, cfg.src_block_size, ("position", "embed"), "position") if learned else None
        self.drop = nn.Dropout(mc.embd_dropout)
        self.encoder = [Block(mc, causal=False, name=f"enc_{i}") for i in range(cfg.n_encoder_layer)]
        self.decoder = [DecoderBlock(mc, name=f"dec_{i}") for i in range(mc.n_layer)]
        if mc.final_norm:
            self.enc_ln_f, self.ln_f = Norm(mc), Norm(mc)
        self.lm_head = lm_head(mc)

    def _embed(self, table: nn.Embed, positions: nn.Embed | None, idx_BT: Array, pos_T: Array, limit: int,
               deterministic: bool) -> Array:
        """`layers.embed` of a source or target at positions `pos_T`, after checking it fits the model (`limit`)."""
        T = idx_BT.shape[1]
        if limit < T:
            raise UserError(f"a sequence of {T} tokens is longer than the model's {limit}: raise block_size "
                            "(targets) or src_block_size (sources)")
        pos_BT = jnp.broadcast_to(pos_T, idx_BT.shape)
        return embed(self.cfg.model, table, positions, self.drop, idx_BT, pos_BT, limit, deterministic)

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
        x_BSC = self._embed(self.src_wte, self.src_wpe, src_BS, jnp.arange(S), self.cfg.src_block_size, deterministic)
        for block in self.encoder:
            x_BSC, _ = block(x_BSC, None, visible_BSS, None, deterministic)
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
        x_BTC = self._embed(self.wte, self.wpe, tgt_BT, jnp.arange(T), self.cfg.model.block_size, deterministic)
        for block in self.decoder:
            x_BTC, _ = block(x_BTC, memory_BSC, visible_BTT, visible_BTS, deterministic)
        return logits(self.wte, self.lm_head, self.ln_f(x_BTC) if self.cfg.model.final_norm else x_BTC)

    def __call__(self, src_BS: Array, tgt_BT: Array, src_mask_BS: Array | None = None,
                 tgt_mask_BT: Array | None = None, deterministic: bool = True) -> Array:
        memory_BSC = self.encode(src_BS, src_mask_BS, deterministic)
        return self.decode(tgt_BT, memory_BSC, self.source_mask(src_BS, src_mask_BS), tgt_mask_BT, deterministic)


    def memory_kv(self, memory_BSC: Array) -> list[tuple[Array, Array]]:
        """Every decoder layer's cross-attention keys and values (B, H, S, D): all decoding needs of the memory."""
        params = self.variables["params"]
        return [Attention(self.cfg.model, causal=False, cross=True, parent=None)
                .bind({"params": params[f"dec_{i}"]["cross"]}).memory_kv(memory_BSC)
                for i in range(self.cfg.model.n_layer)]

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
        x_BTC = self._embed(self.wte, self.wpe, tgt_BT, q_pos_T, mc.block_size, deterministic=True)
        new_cache = []
        for block, kv, layer_cache in zip(self.decoder, memory_kv, cache, strict=True):
            x_BTC, layer_cache = block(x_BTC, kv, visible_1TS, cross_visible_BTS, True, layer_cache, cache_index)
            new_cache.append(layer_cache)
        return logits(self.wte, self.lm_head, self.ln_f(x_BTC) if mc.final_norm else x_BTC), new_cache


def dummy_batch(cfg: Seq2SeqConfig) -> tuple[Array, Array]:
    """The smallest (source, target) pair `init` needs: parameter shapes do not depend on it."""
    zeros = lambda length: jnp.zeros((1, min(length, 8)), jnp.int32)
    return zeros(cfg.src_block_size), zeros(cfg.model.block_size)


def init_params(cfg: Seq2SeqConfig, key: Array) -> dict:
    """Plain (unboxed) float parameters, built under jit."""
    return nn.unbox(jax.jit(Seq2SeqModel(cfg).init)(key, *dummy_batch(cfg))["params"])


def abstract_variables(cfg: Seq2SeqConfig) -> dict:
    """`init`'s variables as boxed ShapeDtypeStructs: shapes and logical axis names, nothing allocated."""
    return jax.eval_shape(Seq2SeqModel(cfg).init, jax.random.key(0), *dummy_batch(cfg))
