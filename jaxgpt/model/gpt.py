"""The GPT family as Flax linen modules: pure functions through `init` / `apply`.

Shapes are named in variable suffixes: B batch, T query length, S key length (the cache
length when decoding), C n_embd, H heads, D head_dim, F d_ff, V vocab, L layers.

The building blocks (projections, norms, MLP) are in `jaxgpt.model.layers`, attention and its key/value cache
in `jaxgpt.model.attention`. Decoding uses an explicit cache: `GPT.decode` takes the cache and the write index
and returns the new cache, so generation state is a plain pytree the caller owns.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgpt.errors import UserError
from jaxgpt.model.attention import Attention, Cache, Windowed
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.layers import MLP, Norm, bias_init, embed, embedding_table, lm_head, logits, param_init, residual
from jaxgpt.ops.attention import Scores, resolve_impl
from jaxgpt.ops.projection import DECLARED

Array = jax.Array


class Block(nn.Module):
    """One transformer layer, pre-norm (GPT-2, seed 000) or post-norm (seeds 001, 004).

    The (carry, xs) -> (carry, ys) signature lets `nn.scan` stack it over layers: the
    residual stream is the carry and the per-layer cache is scanned. A windowed layer (sliding_window) attends over
    `window_BTS`: `windowed` says which layers are, as a static attribute where every layer of a stack is alike
    (listed layers, and scanned ones without a window_pattern), else as `layer_windowed`, a per-layer flag scanned
    with the cache (`GPT.windowed_flags`). With sandwich_norm, `ln_1_post` and `ln_2_post` normalize the
    sub-layers' outputs.
    """

    cfg: ModelConfig
    kernel_storage: str = DECLARED  # `EinsumDense.kernel_storage`
    causal: bool = True  # False: the encoder-decoder's encoder layer (every key visible)
    windowed: bool = False

    @nn.compact
    def __call__(self, x_BTC: Array, cache: Cache | None, visible_BTS: Array, cache_index: Array | None,
                 deterministic: bool, positions_BT: Array | None = None, window_BTS: Array | None = None,
                 layer_windowed: Array | None = None) -> tuple[Array, Cache | None]:
        cfg = self.cfg
        attn = Attention(cfg, causal=self.causal, kernel_storage=self.kernel_storage, name="attn")
        mlp = MLP(cfg, kernel_storage=self.kernel_storage, name="mlp")
        ln_1, ln_2 = Norm(cfg, name="ln_1"), Norm(cfg, name="ln_2")
        post_1, post_2 = (Norm(cfg, name="ln_1_post"), Norm(cfg, name="ln_2_post")) if cfg.sandwich_norm \
            else (None, None)
        windowed: Windowed = self.windowed if layer_windowed is None else layer_windowed
        written = {}

        def self_attention(h_BTC: Array) -> Array:
            y_BTC, written["cache"] = attn(h_BTC, visible_BTS, deterministic, cache, cache_index,
                                           positions_BT=positions_BT, window_BTS=window_BTS, windowed=windowed)
            return y_BTC

        x_BTC = residual(cfg, x_BTC, self_attention, ln_1, deterministic, is_attention=True, post=post_1)
        x_BTC = residual(cfg, x_BTC, lambda h: mlp(h, deterministic), ln_2, deterministic, post=post_2)
        return nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed")), written["cache"]


def _block_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.remat == "none":
        return Block
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "save_dots" else None
    # `deterministic` is a Python bool: it must be static (self=0, x=1, ..., deterministic=5).
    return nn.remat(Block, static_argnums=(5,), policy=policy, prevent_cse=not cfg.scan_layers)


def segment_positions(segments_BT: Array) -> Array:
    """Each token's position within its segment (B, T): 0 where a run of equal ids starts, counting up in it."""
    t_T = jnp.arange(segments_BT.shape[1])
    starts_BT = jnp.concatenate([jnp.ones_like(segments_BT[:, :1], bool), segments_BT[:, 1:] != segments_BT[:, :-1]],
                                axis=1)
    return t_T - jax.lax.cummax(jnp.where(starts_BT, t_T, 0), axis=1)


def document_mask(segments_BT: Array) -> Array:
    """Causal attention within segments (B, T, S): query t sees key s <= t of the same segment id."""
    T = segments_BT.shape[1]
    return jnp.tril(jnp.ones((1, T, T), bool)) & (segments_BT[:, :, None] == segments_BT[:, None, :])


def check_segments(cfg: ModelConfig) -> None:
    """A UserError where the attention would not honour a document mask (`jaxgpt.ops.attention.attend`): splash
    builds its segment ids from padding alone (`splash.padding_segments`)."""
    if resolve_impl(cfg.attention_impl, cfg.dtype, Scores(windowed=cfg.sliding_window is not None)) == "splash":
        raise UserError(f"packed rows (segments) on attention_impl={cfg.attention_impl!r}: splash sees padding, not "
                        "documents; use model.attention_impl='einsum', 'xla' or 'cudnn'")


class GPT(nn.Module):
    """Decoder-only language model: tokens (B, T) -> next-token logits (B, T, V) in float32.

    `kernel_storage` is how the projection kernels are stored (`jaxgpt.ops.projection`): as declared, except
    in the weights `jaxgpt.generate.decode_weights` prepares for batch-1 decoding on CPUs.
    """

    cfg: ModelConfig
    kernel_storage: str = DECLARED

    def setup(self) -> None:
        cfg = self.cfg
        self.wte = embedding_table(cfg, cfg.vocab_size, ("vocab", "embed"), "token")
        self.wpe = embedding_table(cfg, cfg.n_positions, ("position", "embed"), "position") \
            if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.embd_dropout)
        if cfg.embd_norm:
            self.ln_emb = Norm(cfg)
        block = _block_class(cfg)
        windowed = cfg.windowed_layers()
        if cfg.scan_layers:
            self.h = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                             split_rngs={"params": True, "dropout": True},
                             in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                             length=cfg.n_layer, metadata_params={nn.PARTITION_NAME: "layers"}
                             )(cfg, self.kernel_storage, windowed=windowed[0])
        else:
            self.blocks = [block(cfg, self.kernel_storage, windowed=w, name=f"h_{i}") for i, w in enumerate(windowed)]
        if cfg.final_norm:
            self.ln_f = Norm(cfg)
        self.lm_head = lm_head(cfg, self.kernel_storage)

    def _is_pad(self, idx_BT: Array, mask_BT: Array | None) -> Array | None:
        """Padding from the config's pad_id, from an explicit mask (True = real token), or both."""
        pad = None if self.cfg.pad_id is None else idx_BT == self.cfg.pad_id
        if mask_BT is not None:
            pad = ~mask_BT if pad is None else pad | ~mask_BT
        return pad

    def _embed(self, idx_BT: Array, pos_BT: Array, deterministic: bool) -> Array:
        """The embedding (`layers.embed`), normalized by `ln_emb` with embd_norm."""
        x_BTC = embed(self.cfg, self.wte, self.wpe, self.drop, idx_BT, pos_BT, self.cfg.n_positions, deterministic)
        return self.ln_emb(x_BTC) if self.cfg.embd_norm else x_BTC

    def windowed_flags(self) -> Array | None:
        """Scanned layers' per-layer windowed flags (L,), where they differ (a window_pattern); else None: the
        scanned block's `windowed` attribute says it for all. A traced flag makes each layer select its mask and
        rotary frequencies (`attention.per_layer`), keeping one scanned block and the (L, ...) parameter layout
        that a static pattern (a scan over groups of layers) would change."""
        windowed = self.cfg.windowed_layers()
        return jnp.asarray(windowed) if len(set(windowed)) > 1 else None

    def _layers(self, x_BTC: Array, visible_BTS: Array, deterministic: bool, cache: Cache | None = None,
                cache_index: Array | None = None, positions_BT: Array | None = None,
                q_pos_T: Array | None = None) -> tuple[Array, Any]:
        """The layers over `visible_BTS` (and windowed ones over it within the window of the queries at index
        `q_pos_T`, 0.. when None, of the S keys at 0..)."""
        window_BTS = None
        if self.cfg.sliding_window is not None:
            T, S = visible_BTS.shape[1:]
            q_pos_T = jnp.arange(T) if q_pos_T is None else q_pos_T
            window_BTS = visible_BTS & (jnp.arange(S)[None, :] > q_pos_T[:, None] - self.cfg.sliding_window)[None]
        if self.cfg.scan_layers:
            return self.h(x_BTC, cache, visible_BTS, cache_index, deterministic, positions_BT, window_BTS,
                          self.windowed_flags())
        new_cache = []
        for i, block in enumerate(self.blocks):
            x_BTC, c = block(x_BTC, None if cache is None else cache[i], visible_BTS, cache_index, deterministic,
                             positions_BT, window_BTS)
            new_cache.append(c)
        return x_BTC, new_cache

    def hidden(self, idx_BT: Array, mask_BT: Array | None = None, deterministic: bool = True,
               segments_BT: Array | None = None) -> Array:
        """Final hidden states (B, T, C): after the final norm when the model has one.

        `segments_BT` (int, a distinct id per contiguous run of tokens) packs several documents into each row: a
        token then sees only the earlier tokens of its own run, and positions (the table's and the rotary ones)
        restart at each run's start, so each document is computed as if it had the row to itself. Without it
        the program is exactly the unpacked one.
        """
        T = idx_BT.shape[1]
        if segments_BT is None:
            pos_BT = jnp.broadcast_to(jnp.arange(T), idx_BT.shape)
            visible_BTS = jnp.tril(jnp.ones((1, T, T), bool))
        else:
            check_segments(self.cfg)
            pos_BT, visible_BTS = segment_positions(segments_BT), document_mask(segments_BT)
        rotary_pos_BT = None if segments_BT is None else pos_BT
        pad_BT = self._is_pad(idx_BT, mask_BT)
        if self.cfg.pad_positions:
            pos_BT = pos_BT + 1 if pad_BT is None else jnp.where(pad_BT, 0, pos_BT + 1)
        if pad_BT is not None:  # a padding key is hidden, but every query still sees itself
            visible_BTS = (visible_BTS & ~pad_BT[:, None, :]) | jnp.eye(T, dtype=bool)[None]
        x_BTC = self._embed(idx_BT, pos_BT, deterministic)
        x_BTC = nn.with_logical_constraint(x_BTC, ("batch", "length", "act_embed"))
        x_BTC, _ = self._layers(x_BTC, visible_BTS, deterministic, positions_BT=rotary_pos_BT)
        return self.ln_f(x_BTC) if self.cfg.final_norm else x_BTC

    def logits(self, h_BTC: Array) -> Array:
        return logits(self.wte, self.lm_head, h_BTC, self.cfg.logit_softcap)

    def __call__(self, idx_BT: Array, mask_BT: Array | None = None, deterministic: bool = True,
                 segments_BT: Array | None = None) -> Array:
        return self.logits(self.hidden(idx_BT, mask_BT, deterministic, segments_BT))

    def decode(self, idx_BT: Array, cache: Cache | list[Cache], cache_index: Array, logits_at: int | Array | None = None
               ) -> tuple[Array, Cache | list[Cache]]:
        """Run T new tokens at positions cache_index.. against a cache of S = block_size slots.

        Used for both the prompt (prefill, T = prompt length) and each new token (T = 1).
        Returns float32 logits (B, T, V), or with `logits_at` (an index into the T new tokens: a Python int, negative
        from the end, or an int array, one for all rows or (B,) one per row) only that position's, (B, 1, V): a
        prefill samples from its last token's alone (a right-padded prompt's last real one), so the vocabulary's
        head runs for one position, not T. Also the updated cache; slots past the written ones are never visible,
        so the cache may hold stale values there.
        """
        T = idx_BT.shape[1]
        S = (cache["k"] if self.cfg.scan_layers else cache[0]["k"]).shape[-2]
        q_pos_T = cache_index + jnp.arange(T)
        visible_BTS = (jnp.arange(S)[None, :] <= q_pos_T[:, None])[None]
        pos_BT = jnp.broadcast_to(q_pos_T + int(self.cfg.pad_positions), idx_BT.shape)
        x_BTC = self._embed(idx_BT, pos_BT, deterministic=True)
        x_BTC, cache = self._layers(x_BTC, visible_BTS, True, cache, cache_index, q_pos_T=q_pos_T)
        if logits_at is not None and jnp.ndim(logits_at) == 1:  # each row's own position (prompts of a batch)
            x_BTC = jnp.take_along_axis(x_BTC, logits_at[:, None, None], axis=1)
        elif logits_at is not None:  # (a constant index compiles to a plain slice)
            x_BTC = jax.lax.dynamic_slice_in_dim(x_BTC, logits_at % T if isinstance(logits_at, int) else logits_at, 1,
                                                 axis=1)
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
                                 kernel_init=param_init(self.cfg, ("embed", "classes"), role="classes"),
                                 bias_init=bias_init(self.cfg, ("classes",), self.cfg.n_embd, role="classes"))
        self.cls_drop = nn.Dropout(self.cls_dropout)

    def __call__(self, idx_BT: Array, mask_BT: Array | None = None,
                 deterministic: bool = True) -> tuple[Array, Array]:
        h_BTC = self.hidden(idx_BT, mask_BT, deterministic)
        T = idx_BT.shape[1]
        last_cls_B = T - 1 - jnp.argmax((idx_BT == self.cls_token_id)[:, ::-1], axis=1)
        h_BC = jnp.take_along_axis(h_BTC, last_cls_B[:, None, None], axis=1)[:, 0]
        cls_BK = self.cls_head(self.cls_drop(h_BC, deterministic=deterministic))
        return self.logits(h_BTC), cls_BK.astype(jnp.float32)


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
