"""Memory and speed knobs, end to end through train.py: bf16 compute with fp32 state, remat, scan, attention.

Each knob is one short train.py run of the tiny model; the runs go concurrently (each under `timeout`).
Knobs that must not change the math (remat, the attention implementation) give the baseline's losses;
tests/unit/model/test_model.py checks the same equivalences (and scan = unrolled) at the model level.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, TINY, logged_losses

from jaxgpt.io.checkpoint import Checkpointer

pytestmark = pytest.mark.jax_release

STEPS = 8
RUNS = {
    "base": [],
    "bf16": ["--config.model.dtype=bfloat16", "--config.model.param_dtype=float32"],
    "remat_full": ["--config.model.remat=full"],
    "save_dots_xla": ["--config.model.remat=save_dots", "--config.model.attention_impl=xla"],
    "scan_remat": ["--config.model.scan_layers=True", "--config.model.remat=full"],
    "cudnn": ["--config.model.attention_impl=cudnn"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, tuple[int, Path, str]]:
    root = tmp_path_factory.mktemp("knobs")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = {}
    for name, extra in RUNS.items():
        cmd = ["timeout", "300", sys.executable, str(ROOT / "train.py"), f"--config={TINY}",
               f"--config.workdir={root / name}", f"--config.data.dir={data_dir}", f"--config.max_steps={STEPS}",
               "--config.log_interval=1", f"--config.eval_interval={STEPS}", f"--config.ckpt_interval={STEPS}", *extra]
        with open(root / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
    codes = {name: p.wait(timeout=400) for name, p in procs.items()}
    return {name: (codes[name], root / name, (root / f"{name}.err").read_text()) for name in RUNS}


def losses(workdir: Path) -> np.ndarray:
    return np.array([loss for _, loss in logged_losses(workdir)])


def trained(run: tuple[int, Path, str]) -> np.ndarray:
    code, workdir, err = run
    assert code == 0, err[-3000:]
    got = losses(workdir)
    assert len(got) == STEPS and np.all(np.isfinite(got)) and got[-1] < got[0]
    return got


def saved_state(workdir: Path) -> dict:
    ckpt = Checkpointer(workdir, read_only=True)
    restored = ckpt.manager.restore(STEPS, args=ocp.args.Composite(params=ocp.args.StandardRestore(),
                                                                   opt_state=ocp.args.StandardRestore()))
    ckpt.close()
    return {"params": restored["params"], "opt_state": restored["opt_state"]}


@pytest.mark.parametrize("name", ["remat_full", "save_dots_xla"])
def test_knob_leaves_the_math_unchanged(runs: dict, name: str) -> None:
    np.testing.assert_allclose(trained(runs[name]), trained(runs["base"]), atol=1e-5)


def test_scan_over_layers_trains_and_stacks_parameters(runs: dict) -> None:
    trained(runs["scan_remat"])  # scanned layers draw different initial values: no loss comparison with base
    params = saved_state(runs["scan_remat"][1])["params"]
    assert "h" in params and not any(k.startswith("h_") for k in params)
    assert params["h"]["attn"]["qkv"]["kernel"].shape[0] == 2  # (n_layer, C, 3, H, D)


def test_bf16_compute_keeps_fp32_parameters_and_optimizer_state(runs: dict) -> None:
    got, want = trained(runs["bf16"]), trained(runs["base"])
    assert np.max(np.abs(got - want)) < 0.05  # close to fp32 (bf16 has ~3 significant digits) ...
    assert np.max(np.abs(got - want)) > 1e-6  # ... but really computed in bf16
    state = saved_state(runs["bf16"][1])
    dtypes = {np.asarray(x).dtype for x in jax.tree.leaves(state["params"])}
    moments = {np.asarray(x).dtype for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) > 0}
    assert dtypes == {np.dtype("float32")} and moments == {np.dtype("float32")}


def test_bf16_matmuls_in_the_compiled_step() -> None:
    """The trainer's own train step, lowered: bf16 projection products, fp32 parameters in and out."""
    from helpers import load_tiny

    from jaxgpt.ops.attention import work_dtype
    from jaxgpt.tasks.lm import LanguageModelling
    from jaxgpt.train import sharding as layout
    from jaxgpt.train.config import from_config_dict

    c = load_tiny(workdir="w", batch_size=4)
    c.model.vocab_size, c.model.block_size, c.model.dtype, c.model.param_dtype = 256, 64, "bfloat16", "float32"
    cfg = from_config_dict(c)
    prog = layout.build_program(LanguageModelling(cfg, None), cfg.optim, layout.make_mesh(cfg.mesh.shape), 4)
    shape = (1, 4, 64)
    with prog.activate():
        hlo = prog.train_step.lower(prog.abstract_state, prog.abstract_batch({"x": shape, "y": shape}),
                                    prog.abstract_key()).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line and "tensor<" in line]
    projections = [line for line in dots if "batching_dims" not in line]  # attention's have (batch, heads)
    assert projections and all("bf16" in line for line in projections)
    # on CPUs the attention products run in float32 (`attention.work_dtype`); elsewhere in bf16
    assert all(("bf16" in line) == (work_dtype("bfloat16") == "bfloat16") for line in dots if line not in projections)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(prog.abstract_state["params"]))


def test_cudnn_attention_off_gpu_is_a_one_line_error(runs: dict) -> None:
    code, workdir, err = runs["cudnn"]
    assert code == 2 and "attention_impl='cudnn' needs NVIDIA GPUs" in err and "Traceback" not in err
    assert not (workdir / "checkpoints").exists()
