"""What must hold on a GPU or TPU as on a CPU: the checks benchmarks/device_check.py runs on an accelerator host.

The tests marked `accelerator` run on whatever backend JAX has, at the same small shapes
everywhere: on this CPU in the ordinary run, on the device under `pytest -m accelerator tests/` (device_check
sets JAX_PLATFORMS for it, since tests/conftest.py otherwise pins the CPU). The fast paths exist only there:
cuDNN attention on NVIDIA GPUs, splash on TPUs, bf16 products on their matrix units; each is compared with the
float32 einsum path. Products of float32 operands run at precision "highest" (the `highest_precision`
fixture): by default a GPU multiplies float32 in TF32 and a TPU in bf16 passes, which exact comparisons would
read as errors. Checks that other files already make carry the marker there (see docs/accelerators.md).
tests/integration/test_device_check.py checks device_check itself on this CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_tiny
from helpers.attention import outputs_and_grads, qkv, visible_mask
from helpers.models import assert_matches_reference, prompts, random_params, shrink

from jaxgpt.data.dataset import load_dataset
from jaxgpt.generate.sampling import generate
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, init_params
from jaxgpt.model.presets import get_preset
from jaxgpt.ops.attention import attend
from jaxgpt.tasks.lm import LanguageModelling
from jaxgpt.train import sharding as layout
from jaxgpt.train.config import TrainConfig, from_config_dict

pytestmark = pytest.mark.jax_release

BF16_TOL = 0.05  # of the largest magnitude: bf16 keeps 8 bits, and its roundings compound over two layers


@pytest.fixture(autouse=True)
def highest_precision() -> Iterator[None]:
    with jax.default_matmul_precision("highest"):
        yield


def needs(platform: str, what: str) -> None:
    """Skip unless JAX's default backend is `platform` (the fast path `what` exists only there)."""
    if jax.default_backend() != platform:
        pytest.skip(f"{what} runs on {platform} only; this backend is {jax.default_backend()}")


@pytest.mark.accelerator
@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_fused_attention_model_matches_the_float64_reference(impl: str) -> None:
    """The whole model at 128 positions, padded rows included (the einsum path: tests/unit/model/test_model.py)."""
    if impl == "splash":
        needs("tpu", "splash attention (tests/unit/ops/test_kernels.py checks its interpret mode on CPUs)")
    assert_matches_reference(shrink(get_preset("gpt2")).replace(block_size=128, attention_impl=impl), seed=5,
                             padded=True)


@pytest.mark.accelerator
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("impl", "dtype"), [("xla", "float32"), ("cudnn", "bfloat16"), ("splash", "float32")])
def test_attention_paths_equal_einsum_forward_and_gradients(impl: str, dtype: str, padded: bool) -> None:
    """Each fused path against the einsum path on the same inputs (cuDNN takes 16-bit ones only: the reference
    then gets the bf16-rounded values in float32). Padding queries' outputs are not compared (see
    tests/unit/ops/test_kernels.py)."""
    if impl != "xla":
        needs({"cudnn": "gpu", "splash": "tpu"}[impl], f"{impl} attention")
    B, H, T, D = 2, 2, 128, 64
    pad = None
    if padded:
        pad = np.zeros((B, T), bool)
        pad[0, :37], pad[1, -50:] = True, True  # left padding, right padding
    real_BT = np.ones((B, T), bool) if pad is None else ~pad
    weight = jax.random.normal(jax.random.key(1), (B, T, H, D)) * jnp.asarray(real_BT)[:, :, None, None]
    inputs = [x.astype(dtype) for x in (*qkv(B, H, T, D), weight)]
    visible = visible_mask(B, T, pad)
    got_y, got_grads = outputs_and_grads(impl, *inputs[:3], visible, inputs[3])
    want_y, want_grads = outputs_and_grads("einsum", *(x.astype(jnp.float32) for x in inputs[:3]), visible,
                                                    inputs[3].astype(jnp.float32))
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name, got, want in [("y", got_y, want_y), *zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True)]:
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if name == "y":
            got, want = got[real_BT], want[real_BT]
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(), err_msg=name)


@pytest.mark.accelerator
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_cached_bf16_decoding_follows_the_float32_forward_pass(impl: str) -> None:
    """Greedy bf16 decoding with the KV cache (auto: cuDNN on a GPU, splash for the prefill on a TPU): the logits
    of every step within bf16 rounding of the float32 einsum model run once over the tokens it chose."""
    cfg = ModelConfig(vocab_size=61, block_size=64, n_layer=2, n_head=2, n_embd=32)
    params = random_params(cfg)
    prompt = prompts(cfg, 5)
    fast = cfg.replace(dtype="bfloat16", attention_impl=impl)
    tokens, logits = generate(params, fast, prompt, max_new_tokens=20, temperature=0, return_logits=True)
    sequence = jnp.asarray(np.concatenate([prompt, tokens], axis=1)[:, :-1])
    want = np.asarray(GPT(cfg).apply({"params": params}, sequence))[:, prompt.shape[1] - 1:]
    np.testing.assert_allclose(logits, want, rtol=0, atol=BF16_TOL * np.abs(want).max())
    np.testing.assert_array_equal(tokens, logits.argmax(-1))




def test_one_new_token_takes_no_fused_kernel_even_under_vmap() -> None:
    """The serving engine decodes its slots under vmap, where jax's cuDNN attention fails (its batching rule
    mis-reshapes the mask; seen on an H100): one new token must take the one-token path whatever the model's
    `attention_impl`. Here "cudnn", which on a CPU raises if reached, gives the einsum path's values."""
    slots, K, H, S, D = 3, 2, 4, 8, 16
    rng = np.random.default_rng(0)
    q_N11HD = jnp.asarray(rng.normal(size=(slots, 1, 1, H, D)), jnp.float32)
    k_N1K1D, v_N1K1D = (jnp.asarray(rng.normal(size=(slots, 1, K, 1, D)), jnp.float32) for _ in range(2))
    cache_N1KSD = {name: jnp.asarray(rng.normal(size=(slots, 1, K, S, D)), jnp.float32) for name in ("k", "v")}
    index_N = jnp.array([2, 5, 7])

    def decode(impl: str) -> tuple[jax.Array, dict]:
        def one_slot(q: jax.Array, k: jax.Array, v: jax.Array, cache: dict, index: jax.Array) -> tuple:
            y, _, cache = attend(q, k, v, jnp.ones((1, 1, S), bool), impl=impl, dtype="float32", causal=True,
                                 cache=cache, cache_index=index)
            return y, cache
        return jax.vmap(one_slot)(q_N11HD, k_N1K1D, v_N1K1D, cache_N1KSD, index_N)

    got, want = decode("cudnn"), decode("einsum")
    jax.tree.map(np.testing.assert_array_equal, got, want)






def _sharded_losses(tiny: tuple[TrainConfig, LanguageModelling, dict], mesh: jax.sharding.Mesh) -> list[float]:
    """Five steps' losses of the trainer's sharded program (`layout.build_program`) on `mesh`, from `tiny`'s
    parameters; the optimizer state is initialized under jit, in place, as the training loop does."""
    cfg, task, params = tiny
    prog = layout.build_program(task, cfg.optim, mesh, cfg.batch_size)
    params = jax.device_put(params, prog.state_sh["params"])
    state = {"params": params, "opt_state": jax.jit(prog.tx.init, out_shardings=prog.state_sh["opt_state"])(params),
             "step": jax.device_put(jnp.zeros((), jnp.int32), prog.state_sh["step"])}
    losses = []
    with prog.activate():
        for i in range(5):
            batch = jax.device_put(jax.tree.map(lambda rows: rows[None], task.train_rows(i, 0, 1)), prog.batch_sh)
            state, metrics = prog.train_step(state, batch, jax.random.key(1))
            losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def tiny(data_dir: Path) -> tuple[TrainConfig, LanguageModelling, dict]:
    """The tiny config, its task and initial parameters (on the host), where there are two devices to use."""
    if jax.device_count() < 2:
        pytest.skip("needs two devices (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    cfg = from_config_dict(load_tiny(workdir="unused", data_dir=str(data_dir)))
    task = LanguageModelling(cfg, load_dataset(data_dir))
    return cfg, task, jax.device_get(init_params(task.model_cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def one_device(tiny: tuple[TrainConfig, LanguageModelling, dict]) -> list[float]:
    return _sharded_losses(tiny, layout.make_mesh((1, 1, 1), jax.devices()[:1]))


@pytest.mark.accelerator
@pytest.mark.parametrize("mesh", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["data", "fsdp", "tensor"])
def test_two_devices_train_like_one(mesh: tuple[int, int, int], tiny: tuple[TrainConfig, LanguageModelling, dict],
                                    one_device: list[float]) -> None:
    """Data parallel, FSDP and tensor parallel over two devices: the losses of one device (as
    tests/unit/train/test_sharding.py checks on eight fake CPU devices), here on the backend's own devices and
    collectives."""
    two = _sharded_losses(tiny, layout.make_mesh(mesh, jax.devices()[:2]))
    np.testing.assert_allclose(two, one_device, rtol=0, atol=1e-5)
    assert two[-1] < two[0]
