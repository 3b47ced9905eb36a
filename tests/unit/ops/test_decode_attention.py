"""One new token's attention as one kernel (`jaxgpt.ops.decode_attention`, NVIDIA GPUs) equals XLA's path: the
cache written by `write_cache`, then attended over by `attend_written`.

On a CPU the kernel runs in Pallas interpret mode; on a GPU (`pytest -m accelerator`, benchmarks/device_check.py)
compiled by Triton. Rows at their own index as the serving engine's slots decode (vmap), grouped queries, a cache
whose length is no multiple of the kernel's block, and the indices at the edges: the first slot, the last, and past
the end (where `dynamic_update_slice` writes the last slot and every slot is visible). The kernel's second form,
reading multi-head attention's q, k and v from the fused projection (`decode_attention_qkv`), equals the first, and
a model decoding through it (as GPUs do) picks the tokens of the CPU's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.ops.attention import attend_written, heads_of_rows, query_rows, write_cache
from jaxgpt.ops.decode_attention import BLOCK_SLOTS, decode_attention, decode_attention_qkv, fits

pytestmark = [pytest.mark.jax_release,
              pytest.mark.skipif(not fits(1, 16), reason="this jax has no Pallas Triton backend")]
INTERPRET = jax.default_backend() == "cpu"


def xla_path(q_B1HD, k_BK1D, v_BK1D, cache, index, dtype):
    cache = write_cache(cache, k_BK1D, v_BK1D, index)
    return attend_written(q_B1HD, cache["k"], cache["v"], index, dtype), cache


def kernel_path(q_B1HD, k_BK1D, v_BK1D, cache, index, dtype):
    H, K = q_B1HD.shape[2], k_BK1D.shape[1]
    y_BKGD, k, v = decode_attention(query_rows(q_B1HD.transpose(0, 2, 1, 3), K), k_BK1D[:, :, 0], v_BK1D[:, :, 0],
                                    cache["k"], cache["v"], index, interpret=INTERPRET)
    return heads_of_rows(y_BKGD, H), {"k": k, "v": v}


def fused_kernel_path(q_B1HD, k_BK1D, v_BK1D, cache, index, dtype):
    """The kernel reading multi-head attention's queries, keys and values from one (B, 3, H, D) array, the fused
    projection's layout."""
    qkv_B3HD = jnp.stack([q_B1HD[:, 0], k_BK1D[:, :, 0], v_BK1D[:, :, 0]], axis=1)
    y_BH1D, k, v = decode_attention_qkv(qkv_B3HD, cache["k"], cache["v"], index, interpret=INTERPRET)
    return y_BH1D, {"k": k, "v": v}


def inputs(B: int, H: int, K: int, S: int, D: int, dtype: str, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return draw(B, 1, H, D), draw(B, K, 1, D), draw(B, K, 1, D), {"k": draw(B, K, S, D), "v": draw(B, K, S, D)}


@pytest.mark.accelerator
@pytest.mark.parametrize(("B", "H", "K", "S", "D"), [(2, 4, 4, 48, 16), (1, 4, 2, 2 * BLOCK_SLOTS, 32),
                                                      (3, 8, 2, 3 * BLOCK_SLOTS + 8, 16)])
def test_kernel_equals_writing_then_attending(B: int, H: int, K: int, S: int, D: int) -> None:
    q, k, v, cache = inputs(B, H, K, S, D, "float32")
    with jax.default_matmul_precision("highest"):
        for index in (0, 5, S // 2, BLOCK_SLOTS, S - 1, S, S + 7):
            want, want_cache = xla_path(q, k, v, cache, jnp.int32(index), "float32")
            got, got_cache = kernel_path(q, k, v, cache, jnp.int32(index), "float32")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"index {index}")
            jax.tree.map(np.testing.assert_array_equal, got_cache, want_cache)  # the one slot written, exactly


@pytest.mark.accelerator
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_reads_the_fused_projection_as_its_three_parts(dtype: str) -> None:
    """`decode_attention_qkv` (multi-head attention's q, k and v in one array) gives what `decode_attention` gives
    for the same three parts, to the bit, at the edges of the cache and of the kernel's blocks."""
    B, H, S, D = 2, 4, BLOCK_SLOTS + 24, 64
    q, k, v, cache = inputs(B, H, H, S, D, dtype, seed=3)
    for index in (0, BLOCK_SLOTS - 1, BLOCK_SLOTS, S - 1, S + 3):
        want = kernel_path(q, k, v, cache, jnp.int32(index), dtype)
        got = fused_kernel_path(q, k, v, cache, jnp.int32(index), dtype)
        jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.accelerator
def test_kernel_decodes_each_row_at_its_own_index_under_vmap() -> None:
    """The serving engine vmaps a batch-1 decode step over its slots, each at its own position."""
    q, k, v, cache = inputs(4, 4, 2, 80, 16, "float32", seed=1)
    index = jnp.array([0, 17, 64, 79], jnp.int32)
    per_row = lambda f: jax.jit(jax.vmap(lambda q, k, v, c, i: f(q[None], k[None], v[None],
                                                                   jax.tree.map(lambda a: a[None], c), i, "float32")))
    with jax.default_matmul_precision("highest"):
        want, want_cache = per_row(xla_path)(q, k, v, cache, index)
        got, got_cache = per_row(kernel_path)(q, k, v, cache, index)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, got_cache, want_cache)
    q, k, v, cache = inputs(4, 2, 2, 80, 16, "float32", seed=4)  # the fused projection's form: multi-head only
    jax.tree.map(np.testing.assert_array_equal, per_row(fused_kernel_path)(q, k, v, cache, index),
                 per_row(kernel_path)(q, k, v, cache, index))


@pytest.mark.accelerator
def test_kernel_in_bfloat16_is_within_its_rounding() -> None:
    """bf16 operands and cache, float32 within the kernel: no further from the float32 result than XLA's bf16 path
    (whose scores and probabilities are rounded to bf16 on the way), by more than bf16's own rounding."""
    q, k, v, cache = inputs(2, 4, 4, 96, 64, "bfloat16", seed=2)
    index = jnp.int32(70)
    exact, _ = xla_path(*(jax.tree.map(lambda a: a.astype(jnp.float32), (q, k, v, cache))), index, "float32")
    xla, _ = xla_path(q, k, v, cache, index, "bfloat16")
    got, got_cache = kernel_path(q, k, v, cache, index, "bfloat16")
    assert got.dtype == jnp.bfloat16 and got_cache["k"].dtype == jnp.bfloat16
    xla_error = float(jnp.abs(xla.astype(jnp.float32) - exact).max())
    assert float(jnp.abs(got.astype(jnp.float32) - exact).max()) <= xla_error + 2 ** -8 * float(jnp.abs(exact).max())


def test_fits_powers_of_two() -> None:
    assert fits(1, 64) and fits(4, 128) and not fits(3, 64) and not fits(1, 48) and not fits(1, 8)


def test_a_model_decodes_through_the_fused_projection_as_through_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's wiring of `attention.attend_qkv` (GPUs only: here forced, the kernel in interpret mode): greedy
    decoding picks the same tokens, with logits within float32 rounding of the CPU's own decode path."""
    from jaxgpt.generate.sampling import generate
    from jaxgpt.model.config import ModelConfig
    from jaxgpt.model.gpt import init_params
    from jaxgpt.ops import attention

    cfg = ModelConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32)
    params = init_params(cfg, jax.random.key(0))
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, (3, 4))
    decode = lambda: generate(params, cfg, prompt, max_new_tokens=BLOCK_SLOTS - 2, temperature=0, return_logits=True)
    want_tokens, want_logits = decode()
    calls = []

    def kernel(*args: object) -> tuple:
        calls.append(1)
        return decode_attention_qkv(*args, interpret=True)

    monkeypatch.setattr(attention, "one_kernel_decode", lambda *_: True)
    monkeypatch.setattr(attention.decode_attention, "decode_attention_qkv", kernel)
    jax.clear_caches()  # the programs above were traced without the kernel
    try:
        got_tokens, got_logits = decode()
    finally:
        jax.clear_caches()  # nor may later tests reuse the programs traced with it
    assert calls  # the kernel ran (traced once per layer of each program)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
