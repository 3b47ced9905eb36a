"""Training-loop checks of the accelerator subset (marker `accelerator`: benchmarks/device_check.py runs them on
a GPU or TPU host, tests/unit/test_accelerator.py says how): configs/gpt2_124m.py's bf16 recipe tracks float32, and
a run resumed halfway equals the straight run bit for bit. Moved from tests/unit/test_accelerator.py: each trains.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import load_tiny, logged_losses, train_run

pytestmark = pytest.mark.jax_release


def _run_losses(workdir: Path, data_dir: Path, cache: str, steps: int, loss_chunk: int, **model: object
                ) -> np.ndarray:
    """The train loss of every step of the tiny config through the training loop."""
    c = load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=steps, log_interval=1,
                  eval_interval=steps, ckpt_interval=steps, loss_chunk=loss_chunk, compilation_cache_dir=cache)
    c.model.update(block_size=128, **model)
    train_run(c)
    return np.array([loss for _, loss in logged_losses(workdir)])


@pytest.mark.accelerator
def test_bf16_recipe_tracks_float32_for_50_steps(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    """configs/gpt2_124m.py's numerics (bf16 compute over float32 parameters, `auto` attention, the chunked
    loss) against float32 einsum attention and the dense loss, by tests/unit/ops/test_bf16.py's tolerance: running
    means of five steps within 2%, and the final ones. 128 positions: splash tiles them on a TPU."""
    f32 = _run_losses(tmp_path / "f32", data_dir, xla_cache, 50, 0)
    bf16 = _run_losses(tmp_path / "bf16", data_dir, xla_cache, 50, 32, dtype="bfloat16", attention_impl="auto")
    assert len(f32) == len(bf16) == 50 and f32[-5:].mean() < f32[0] - 0.5  # it learns
    window = np.ones(5) / 5
    smooth_f32, smooth_bf16 = np.convolve(f32, window, "valid"), np.convolve(bf16, window, "valid")
    assert (np.abs(smooth_bf16 - smooth_f32) / smooth_f32).max() <= 0.02
    assert abs(bf16[-5:].mean() - f32[-5:].mean()) <= 0.02 * f32[-5:].mean()


@pytest.mark.accelerator
def test_twenty_steps_then_resume_equal_forty_straight(tmp_path: Path, data_dir: Path, xla_cache: str) -> None:
    """Bitwise: parameters and every logged loss. Dropout is on, so its randomness must resume too; the first
    half stops at 20 with the 40-step run's schedule (an explicit decay_steps), so no update differs. On a GPU
    this needs `deterministic` (an H100 without it: 1e-5 relative differences, XLA's atomics summing in
    whatever order threads finish); with it, bitwise there too."""
    def run(name: str, steps: int) -> dict:
        c = load_tiny(workdir=str(tmp_path / name), data_dir=str(data_dir), max_steps=steps,
                      compilation_cache_dir=xla_cache, deterministic=True)
        c.optim.decay_steps = 40
        c.model.resid_dropout = 0.1
        return train_run(c)

    straight = run("straight", 40)
    assert run("halves", 20)["steps"] == 20
    resumed = run("halves", 40)
    assert resumed["steps"] == 20
    for a, b in zip(jax.tree.leaves(straight["state"]["params"]), jax.tree.leaves(resumed["state"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert logged_losses(tmp_path / "halves") == logged_losses(tmp_path / "straight")
