"""Sharded training equals single-device training, and checkpoints move between meshes.

Eight fake CPU devices need XLA_FLAGS before jax is imported, so the multi-device runs happen in one
subprocess (the real training loop, `jaxgpt.train.loop.train`, once per mesh); the single-device runs happen here,
in the test process, which stays on one device.
(Moved from tests/unit/train/test_sharding.py: each trains.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, fake_devices_env, logged_losses

pytestmark = pytest.mark.jax_release

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
STEPS = 10
SAVED_AT = 5  # the (1, 8, 1) run's checkpoint that the other meshes resume from
TOL = 1e-5

# A model whose heads (4), widths (32, 128) and batch (8) divide every mesh axis above; the character
# vocabulary (95) does not divide the tensor axis, so the rules replicate it, as they would GPT-2's 50257.
OVERRIDES = dict(max_steps=STEPS, log_interval=1, eval_interval=STEPS, ckpt_interval=SAVED_AT)

WORKER = """
import json, os, sys
sys.path.insert(0, {tests!r})
from helpers import load_tiny, train_run

def run(workdir, mesh, **overrides):
    c = load_tiny(workdir=workdir, data_dir={data!r}, **{overrides!r})
    c.model.n_head = 4
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    train_run(c)

for mesh in {meshes!r}:
    run(os.path.join({root!r}, "mesh_%d_%d_%d" % tuple(mesh)), mesh)
if {move!r}:  # resume the (1, 8, 1) run's step-{saved} checkpoint on (2, 2, 2)
    import shutil
    moved = os.path.join({root!r}, "moved_222")
    shutil.copytree(os.path.join({root!r}, "mesh_1_8_1"), moved)
    shutil.rmtree(os.path.join(moved, "checkpoints", "{steps}"))
    run(moved, (2, 2, 2))
print("WORKER-DONE")
"""


def losses(workdir: Path) -> dict[int, float]:
    return dict(logged_losses(workdir))


def train_on_meshes(root: Path, data_dir: Path, meshes: list[tuple[int, int, int]], move: bool) -> Path:
    """The runs on `meshes` (and, with `move`, the (1, 8, 1) checkpoint resumed on (2, 2, 2)), in one subprocess
    with 8 fake CPU devices."""
    script = WORKER.format(tests=str(ROOT / "tests"), data=str(data_dir), overrides=OVERRIDES, meshes=meshes,
                           root=str(root), saved=SAVED_AT, steps=STEPS, move=move)
    proc = subprocess.run(["timeout", "900", sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env=fake_devices_env(8), timeout=960)
    assert proc.returncode == 0 and "WORKER-DONE" in proc.stdout, proc.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """All 8-device runs and the checkpoint's move (about 1.5 CPU-minutes: the slow tier's)."""
    return train_on_meshes(tmp_path_factory.mktemp("meshes"), data_dir, MESHES, move=True)


@pytest.fixture(scope="module")
def run_222(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The one mesh whose three axes all split (data, FSDP and tensor parallel at once): the default run's."""
    return train_on_meshes(tmp_path_factory.mktemp("mesh_222"), data_dir, [(2, 2, 2)], move=False)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The reference: the same training on this process's single device."""
    from helpers import load_tiny, train_run

    workdir = tmp_path_factory.mktemp("single") / "run"
    c = load_tiny(workdir=str(workdir), data_dir=str(data_dir), **OVERRIDES)
    c.model.n_head = 4
    train_run(c)
    return workdir


def assert_same_losses(got: dict[int, float], want: dict[int, float], mesh: tuple[int, int, int]) -> None:
    assert sorted(got) == list(range(1, STEPS + 1)) and got.keys() == want.keys()
    diffs = {s: abs(got[s] - want[s]) for s in want}
    print(f"mesh {mesh}: max |loss - single-device loss| over {STEPS} steps = {max(diffs.values()):.2e}")
    assert max(diffs.values()) < TOL, diffs
    assert want[STEPS] < want[1]  # it trains


def test_2x2x2_mesh_losses_equal_single_device(run_222: Path, single: Path) -> None:
    """The slow tier's four meshes' cheap sibling: data, FSDP and tensor parallel at once, each axis of 2."""
    assert_same_losses(losses(run_222 / "mesh_2_2_2"), losses(single), (2, 2, 2))


@pytest.mark.slow  # a subprocess training on four meshes and resuming a moved checkpoint: the sibling is above
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_mesh_losses_equal_single_device(mesh: tuple[int, int, int], runs: Path, single: Path) -> None:
    assert_same_losses(losses(runs / "mesh_{}_{}_{}".format(*mesh)), losses(single), mesh)


@pytest.mark.slow  # the sibling above trains on (2, 2, 2) from the start; this one moves a checkpoint there
def test_checkpoint_from_fsdp8_resumes_on_one_device_and_on_2x2x2(runs: Path, single: Path, data_dir: Path) -> None:
    from helpers import load_tiny, train_run

    moved = runs / "moved_1"  # (1, 8, 1) checkpoint -> this process's single device
    shutil.copytree(runs / "mesh_1_8_1", moved)
    shutil.rmtree(moved / "checkpoints" / str(STEPS))
    c = load_tiny(workdir=str(moved), data_dir=str(data_dir), **OVERRIDES)
    c.model.n_head = 4
    c.mesh.data = 1
    train_run(c)

    want = losses(single)
    for workdir in (moved, runs / "moved_222"):
        got = losses(workdir)
        assert sorted(got) == list(range(1, STEPS + 1))
        resumed = {s: abs(got[s] - want[s]) for s in range(SAVED_AT + 1, STEPS + 1)}
        print(f"{workdir.name}: max |loss - uninterrupted loss| after the resume = {max(resumed.values()):.2e}")
        assert max(resumed.values()) < TOL, (workdir.name, resumed)
