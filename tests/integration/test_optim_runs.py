"""Muon on the training loop: a scanned model with Muon, WSD and z-loss resumes bit-exact, and (slow tier) trains
sharded over fsdp and tensor as on one device. Moved from tests/unit/train/test_optim.py: each trains."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import load_tiny, logged_losses, train_run
from helpers.runs import run_train, train_cmd


def test_muon_run_resumes_bit_exact(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """A scanned model with Muon, WSD and z-loss: 8 steps straight equal 4 steps, a restart, then 4 more."""

    def run(workdir: Path, max_steps: int) -> dict:
        c = load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=max_steps, eval_interval=4,
                      log_interval=1, z_loss=1e-4, compilation_cache_dir=str(tmp_path / "xla"))
        c.model.scan_layers = True
        c.optim.update(optimizer="muon", schedule="wsd", warmup_steps=2, decay_steps=8, cooldown_fraction=0.5)
        return train_run(c)["state"]["params"]

    want = run(tmp_path / "straight", 8)
    assert "optimizer groups: muon 24,576 parameters in 4 leaves" in capsys.readouterr().out
    run(tmp_path / "split", 4)
    got = run(tmp_path / "split", 8)
    assert "resuming at step 4" in capsys.readouterr().out
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert logged_losses(tmp_path / "split") == logged_losses(tmp_path / "straight")


@pytest.mark.slow
def test_muon_sharded_over_fsdp_and_tensor_trains_like_one_device(tmp_path: Path, data_dir: Path) -> None:
    """Newton-Schulz on scanned kernels split over 2 x 2 CPU devices (fsdp, tensor): one device's losses."""
    muon = ["--config.optim.optimizer=muon", "--config.model.scan_layers=True", "--config.max_steps=6",
            "--config.log_interval=2", "--config.eval_interval=6"]
    cache = str(tmp_path / "xla")
    run_train(*train_cmd(tmp_path / "one", data_dir, cache, *muon))
    four = run_train(*train_cmd(tmp_path / "four", data_dir, cache, *muon, "--config.cpu_devices=4",
                                "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"))
    assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 2}" in four.stdout
    losses_one, losses_four = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "four")
    assert [s for s, _ in losses_one] == [s for s, _ in losses_four] == [2, 4, 6]
    np.testing.assert_allclose([v for _, v in losses_four], [v for _, v in losses_one], rtol=1e-5)
