"""Named model configurations: each system described in the seed articles, and the GPT-2 family.

Each preset reproduces the published size and every architectural choice of its source;
configs override sizes (vocabulary, block size) to fit a dataset.
"""

from __future__ import annotations

from typing import Any

from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig

# The seed articles' models were first named after the articles; those names stay valid everywhere a preset
# is named (configs, --preset, old configs in run directories).
ALIASES = {"seed000": "annotated-transformer-decoder", "seed001": "gpt1", "seed002": "keras-transformer-decoder",
           "seed004": "keras-mini-gpt", "seed000-encdec": "annotated-transformer",
           "seed002-encdec": "keras-transformer"}


class _Named(dict):
    """Presets by name, answering to the old seed names too (listing only the descriptive ones)."""

    def __missing__(self, key: str) -> Any:
        if key in ALIASES and ALIASES[key] in self:
            return self[ALIASES[key]]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return super().__contains__(ALIASES.get(key, key) if isinstance(key, str) else key)

_GPT2 = dict(vocab_size=50257, block_size=1024, activation="gelu_tanh", norm_placement="pre", final_norm=True,
             tie_embeddings=True, use_bias=True, norm_eps=1e-5, init="gpt2")

_OPEN = dict(position="none", norm_placement="pre", final_norm=True, norm="rmsnorm", activation="silu",
             gated_mlp=True, use_bias=False)

PRESETS: dict[str, ModelConfig] = _Named({
    # Seed 000: the Annotated Transformer's decoder stack as a GPT (`make_model`), with tiktoken's r50k vocabulary.
    # Dropout on the embedding + position sum, inside attention and the feed-forward, and on each sub-layer's
    # output; Xavier-uniform matrices with PyTorch's default nn.Linear biases.
    "annotated-transformer-decoder": ModelConfig(
        vocab_size=50257, block_size=1024, n_layer=6, n_embd=512, n_head=8, d_ff=2048,
        position="sinusoidal", scale_embeddings=True, norm_placement="pre", final_norm=True,
        norm="unbiased_std", norm_eps=1e-6, activation="relu", use_bias=True, tie_embeddings=False,
        embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, ff_dropout=0.1, init="xavier_torch"),
    # Seed 001: GPT-1-style post-norm decoder, learned positions 1..T with 0 for padding, tied head.
    # GPT-1's published vocabulary (40,478 BPE tokens); the padding id is 0 as in the seed. Its embedding dropout
    # acts on the token embedding before the positions are added; its modules keep PyTorch's default init except
    # the explicit normal(0.02) token table and feed-forward weights (init="gpt1_torch").
    "gpt1": ModelConfig(
        vocab_size=40478, block_size=512, n_layer=12, n_embd=768, n_head=12, d_ff=3072,
        position="learned", pad_positions=True, pad_id=0, norm_placement="post", final_norm=False,
        norm="layernorm", norm_eps=1e-5, activation="gelu", use_bias=True, tie_embeddings=True,
        embd_dropout=0.1, embd_dropout_site="tokens", attn_dropout=0.1, resid_dropout=0.1, init="gpt1_torch"),
    # Seed 002: its Keras decoder stack without cross-attention: concatenated sin/cos positions, scaled
    # embeddings, post-norm "Add & Norm" with Keras' eps 1e-3, per-head key_dim = d_model, 2048-token vocab.
    # Keras' `mask_zero=True` embedding: token 0 is padding, hidden as a key. Dropout inside attention and after
    # the feed-forward only (its attention layers add their output to the residual undropped).
    "keras-transformer-decoder": ModelConfig(
        vocab_size=2048, block_size=2048, n_layer=6, n_embd=512, n_head=8, head_dim=512, d_ff=2048,
        position="sinusoidal_concat", scale_embeddings=True, norm_placement="post", final_norm=False,
        norm="layernorm", norm_eps=1e-3, activation="relu", use_bias=True, tie_embeddings=False,
        pad_id=0, attn_dropout=0.1, resid_dropout=0.1, attn_resid_dropout=False, init="xavier"),
    # Seed 004: the one-block Keras GPT of "Generative Deep Learning" (10k vocab, 80 tokens, 256 wide,
    # 2 heads with key_dim 256, feed-forward 256), post-norm with eps 1e-6, softmax head untied.
    "keras-mini-gpt": ModelConfig(
        vocab_size=10000, block_size=80, n_layer=1, n_embd=256, n_head=2, head_dim=256, d_ff=256,
        position="learned", norm_placement="post", final_norm=False, norm="layernorm", norm_eps=1e-6,
        activation="relu", use_bias=True, tie_embeddings=False, resid_dropout=0.1, init="xavier"),
    "gpt2": ModelConfig(n_layer=12, n_embd=768, n_head=12, **_GPT2),
    "gpt2-medium": ModelConfig(n_layer=24, n_embd=1024, n_head=16, **_GPT2),
    "gpt2-large": ModelConfig(n_layer=36, n_embd=1280, n_head=20, **_GPT2),
    "gpt2-xl": ModelConfig(n_layer=48, n_embd=1600, n_head=25, **_GPT2),
    # A GPT-3-family 6.7B shape (32 x 4096, 2048 context) for pod-scale planning.
    "gpt-6.7b": ModelConfig(n_layer=32, n_embd=4096, n_head=32, **{**_GPT2, "block_size": 2048}),
    # nanochat's GPT at depth 12 (its d12: 12 layers, 768 wide, 6 heads of 128, a 2^16-token vocabulary,
    # 2048 context): rotary positions (base 100000) instead of position embeddings, QK-norm, ReLU^2, no biases,
    # parameter-free RMSNorm before each sub-layer, after the embedding and at the end, an untied head, logits
    # soft-capped at 15, zero-initialised residual projections. Grouped-query attention is an option there
    # (n_kv_head), off by default as here.
    "nanochat-d12": ModelConfig(
        vocab_size=65536, block_size=2048, n_layer=12, n_embd=768, n_head=6, position="none", rope_theta=100000.0,
        norm_placement="pre", final_norm=True, norm="rmsnorm", norm_scale=False, norm_eps=1e-6, embd_norm=True,
        qk_norm=True, activation="relu2", use_bias=False, tie_embeddings=False, logit_softcap=15.0,
        zero_init_proj=True),
    # Open-weight models at their published sizes (what their config.json gives, `jaxgpt.io.hf_llama`), for
    # `jaxgpt summary` and `jaxgpt aot`; the weights themselves load with init_from=hf:DIR or gguf:PATH. Each is
    # rotary, RMSNorm before each sub-layer, grouped-query attention, a SwiGLU (Gemma: GeGLU) feed-forward, no biases.
    # Llama 3.1 8B: 8,030,261,248 parameters (llama3 RoPE scaling to 128k positions, untied head).
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, block_size=131072, n_layer=32, n_head=32, n_embd=4096, d_ff=14336, n_kv_head=8,
        rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_positions=8192,
        tie_embeddings=False, **_OPEN),
    # Mistral 7B v0.1: 7,241,732,096 (a 4096-token window on every layer).
    "mistral-7b-v0.1": ModelConfig(
        vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_embd=4096, d_ff=14336, n_kv_head=8,
        rope_theta=10000.0, sliding_window=4096, tie_embeddings=False, **_OPEN),
    # Qwen3 8B: 8,190,735,360 (RMSNorm on each query and key head before the rotary).
    "qwen3-8b": ModelConfig(
        vocab_size=151936, block_size=40960, n_layer=36, n_head=32, n_embd=4096, head_dim=128, d_ff=12288,
        n_kv_head=8, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, qk_norm_site="before_rope",
        tie_embeddings=False, **_OPEN),
    # SmolLM2 135M (the Instruct model of gguf:smollm2): 134,515,008 (tied head).
    "smollm2-135m": ModelConfig(
        vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_embd=576, d_ff=1536, n_kv_head=3,
        rope_theta=100000.0, tie_embeddings=True, **_OPEN),
    # Gemma 3 1B (text): 999,885,952 ((1 + w) sandwich norms, embeddings times sqrt(C), GeGLU, a query scale of
    # 256^-0.5, 512-token windows with every 6th layer global at its own rotary base, tied head).
    "gemma-3-1b": ModelConfig(
        vocab_size=262144, block_size=32768, n_layer=26, n_head=4, n_embd=1152, head_dim=256, d_ff=6912,
        n_kv_head=1, rope_theta=1000000.0, rope_local_theta=10000.0, norm_eps=1e-6, qk_norm=True,
        qk_norm_site="before_rope", norm_scale_offset=1.0, sandwich_norm=True, scale_embeddings=True,
        query_scale=0.0625, sliding_window=512, window_pattern=6, tie_embeddings=True,
        **{**_OPEN, "activation": "gelu_tanh"}),
})


# Encoder-decoder models (`jaxgpt.model.encdec`): `model` holds the decoder and the choices both stacks share.
SEQ2SEQ_PRESETS: dict[str, Seq2SeqConfig] = _Named({
    # Seed 002's Keras Transformer: 6 + 6 post-norm layers, 512 wide, 8 heads of key_dim = value_dim = 512,
    # feed-forward 2048, src_size = tgt_size = 2048 with mask_zero (pad id 0), concatenated sin/cos positions
    # over a table of vocab_size rows (so at most 2048 tokens), untied softmax head with bias. Its summary:
    #   one attention, 3 x (512x8x512 + 8x512) + (8x512x512 + 512)   =  8,401,408;  LayerNorm 2 x 512 = 1,024
    #   feed-forward (512x2048 + 2048) + (2048x512 + 512)            =  2,099,712;  embedding 2048 x 512 = 1,048,576
    #   encoder: 1,048,576 + 6 x (8,401,408 + 2,099,712 + 2 x 1,024)          =  64,067,584
    #   decoder: 1,048,576 + 6 x (2 x 8,401,408 + 2,099,712 + 3 x 1,024)      = 114,482,176
    #   output Dense 512 x 2048 + 2048 = 1,050,624;  total 179,600,384.
    # Keras applies dropout inside attention and after the feed-forward only (attn_resid_dropout=False), and
    # masks token 0 (pad_id) in every attention. (The article sizes the decoder's embedding by src_size too; with
    # both vocabularies 2048 that changes nothing, here it is the target's.)
    "keras-transformer": Seq2SeqConfig(
        model=PRESETS["seed002"], n_encoder_layer=6, src_vocab_size=2048, src_block_size=2048),
    # Seed 000's source, the Annotated Transformer, `make_model(src_vocab, tgt_vocab, N=6, d_model=512, d_ff=2048,
    # h=8, dropout=0.1)`: pre-norm sub-layers with its unbiased-std LayerNorm (eps 1e-6) and a final norm after
    # each stack, sin/cos positions interleaved (a 5000-row table), Xavier matrices with PyTorch's default biases,
    # dropout 0.1 everywhere. Its code keeps the source and target embeddings and the Generator's biased Linear
    # separate (the paper's sharing is share_embeddings / tie_embeddings); both vocabularies are seed 000's r50k
    # (50,257 tokens).
    "annotated-transformer": Seq2SeqConfig(
        model=PRESETS["seed000"].replace(block_size=5000), n_encoder_layer=6, src_vocab_size=50257),
})


def get_seq2seq_preset(name: str) -> Seq2SeqConfig:
    try:
        return SEQ2SEQ_PRESETS[name]
    except KeyError:
        raise UserError(f"unknown encoder-decoder preset {name!r}: choose one of {sorted(SEQ2SEQ_PRESETS)}") from None


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}") from None
