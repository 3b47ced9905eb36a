"""Named model configurations: each system described in the seed articles, and the GPT-2 family.

Each preset reproduces the published size and every architectural choice of its source;
configs override sizes (vocabulary, block size) to fit a dataset.
"""

from __future__ import annotations

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError

_GPT2 = dict(vocab_size=50257, block_size=1024, activation="gelu_tanh", norm_placement="pre", final_norm=True,
             tie_embeddings=True, use_bias=True, norm_eps=1e-5, init="gpt2")

PRESETS: dict[str, ModelConfig] = {
    # Seed 000: the Annotated Transformer's decoder stack as a GPT (`make_model`), with tiktoken's r50k vocabulary.
    "seed000": ModelConfig(
        vocab_size=50257, block_size=1024, n_layer=6, n_embd=512, n_head=8, d_ff=2048,
        position="sinusoidal", scale_embeddings=True, norm_placement="pre", final_norm=True,
        norm="unbiased_std", norm_eps=1e-6, activation="relu", use_bias=True, tie_embeddings=False,
        embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, ff_dropout=0.1, init="xavier"),
    # Seed 001: GPT-1-style post-norm decoder, learned positions 1..T with 0 for padding, tied head.
    # GPT-1's published vocabulary (40,478 BPE tokens); the padding id is 0 as in the seed.
    "seed001": ModelConfig(
        vocab_size=40478, block_size=512, n_layer=12, n_embd=768, n_head=12, d_ff=3072,
        position="learned", pad_positions=True, pad_id=0, norm_placement="post", final_norm=False,
        norm="layernorm", norm_eps=1e-5, activation="gelu", use_bias=True, tie_embeddings=True,
        embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, init="gpt2"),
    # Seed 002: its Keras decoder stack without cross-attention: concatenated sin/cos positions, scaled
    # embeddings, post-norm "Add & Norm" with Keras' eps 1e-3, per-head key_dim = d_model, 2048-token vocab.
    "seed002": ModelConfig(
        vocab_size=2048, block_size=2048, n_layer=6, n_embd=512, n_head=8, head_dim=512, d_ff=2048,
        position="sinusoidal_concat", scale_embeddings=True, norm_placement="post", final_norm=False,
        norm="layernorm", norm_eps=1e-3, activation="relu", use_bias=True, tie_embeddings=False,
        attn_dropout=0.1, resid_dropout=0.1, init="xavier"),
    # Seed 004: the one-block Keras GPT of "Generative Deep Learning" (10k vocab, 80 tokens, 256 wide,
    # 2 heads with key_dim 256, feed-forward 256), post-norm with eps 1e-6, softmax head untied.
    "seed004": ModelConfig(
        vocab_size=10000, block_size=80, n_layer=1, n_embd=256, n_head=2, head_dim=256, d_ff=256,
        position="learned", norm_placement="post", final_norm=False, norm="layernorm", norm_eps=1e-6,
        activation="relu", use_bias=True, tie_embeddings=False, resid_dropout=0.1, init="xavier"),
    "gpt2": ModelConfig(n_layer=12, n_embd=768, n_head=12, **_GPT2),
    "gpt2-medium": ModelConfig(n_layer=24, n_embd=1024, n_head=16, **_GPT2),
    "gpt2-large": ModelConfig(n_layer=36, n_embd=1280, n_head=20, **_GPT2),
    "gpt2-xl": ModelConfig(n_layer=48, n_embd=1600, n_head=25, **_GPT2),
    # A GPT-3-family 6.7B shape (32 x 4096, 2048 context) for pod-scale planning.
    "gpt-6.7b": ModelConfig(n_layer=32, n_embd=4096, n_head=32, **{**_GPT2, "block_size": 2048}),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}") from None
