"""A training step with nothing for a GPU to wait on, pinned on this CPU: the step's order of host work (batches
sent ahead, metrics fetched a step late), the chunked loss without loops, and the program compiled for an H100.

The GPU-program tests compile for compile-only H100s through jax's CUDA plugin (`pip install "jax[cuda13]"`,
which installs on CPU-only hosts: `jaxgpt.tools.gpus`) and skip, saying so, where it is not installed. The rest run
everywhere.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, aot_cli, load_tiny, logged_records, train_run

from jaxgpt.errors import UserError
from jaxgpt.ops.loss import chunked_cross_entropy
from jaxgpt.tools import gpus, hlo

pytestmark = pytest.mark.cuda_plugin

needs_plugin = pytest.mark.skipif(not gpus.has_cuda_plugin(), reason='jax\'s CUDA plugin is not installed (pip install '
                                  '"jax[cuda13]": it compiles for GPUs on CPU-only hosts)')


def test_metrics_are_fetched_a_step_late_and_batches_sent_a_step_ahead(tmp_path: Path, data_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of the loop's host work: step i+1's batch is made right after step i is dispatched (it travels
    while step i runs), and a log interval's metrics are read after the next step is queued, so the device never
    waits for the host between steps. Steps that evaluate (the last) fetch theirs at once. Same rows as asked."""
    from jaxgpt.train import loop

    events: list[str] = []
    fed: dict[int, np.ndarray] = {}
    batch, flush, steps = loop.Feed.batch, loop.Meter.flush, loop._steps

    def recorded_batch(feed: Any, step: int, params: Any) -> dict:
        events.append(f"batch{step}")
        out = batch(feed, step, params)
        fed[step] = np.asarray(out["x"])
        return out

    def recorded_flush(meter: Any, step: int, ckpt: Any) -> None:
        if meter.pending:
            events.append(f"fetch{step}")
        flush(meter, step, ckpt)

    def recorded_steps(cfg: Any, task: Any, compiled: Any, *args: Any) -> Any:
        def step(state: dict, batch: dict, key: jax.Array) -> Any:
            events.append(f"step{len([e for e in events if e.startswith('step')])}")
            assert any(np.array_equal(np.asarray(batch["x"]), x) for x in fed.values())
            return compiled(state, batch, key)

        return steps(cfg, task, step, *args)

    monkeypatch.setattr(loop.Feed, "batch", recorded_batch)
    monkeypatch.setattr(loop.Meter, "flush", recorded_flush)
    monkeypatch.setattr(loop, "_steps", recorded_steps)
    c = load_tiny(workdir=str(tmp_path / "run"), data_dir=str(data_dir), max_steps=5, log_interval=2,
                  eval_interval=1000, ckpt_interval=1000)
    train_run(c)
    assert events == ["batch0", "batch0", "step0", "batch1", "step1", "batch2", "step2", "batch3", "fetch2",
                      "step3", "batch4", "step4", "fetch4", "fetch5"]
    rows = logged_records(tmp_path / "run")
    assert [r["step"] for r in rows if "tokens_per_sec" in r] == [2, 4, 5]  # the step rows (not the evaluation)


def _loss_and_grads(unroll: bool, chunk: int = 16) -> tuple[Any, Any]:
    h_BTC = jax.random.normal(jax.random.key(0), (2, 64, 16))
    w_CV = jax.random.normal(jax.random.key(1), (16, 97))
    y_BT = jax.random.randint(jax.random.key(2), (2, 64), 0, 97)
    loss = lambda h, w: chunked_cross_entropy(lambda x: x @ w, h, y_BT, chunk, z_loss_weight=1e-2, unroll=unroll)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return f(h_BTC, w_CV), f.lower(h_BTC, w_CV).compile().as_text()


def test_unrolled_chunked_loss_equals_the_scan_and_has_no_loop() -> None:
    """The GPU layout of the chunked loss (unrolled, chunks kept in order) gives the scan's loss and gradients, and
    its compiled program has no while loop, where the scan's has its forward and backward loops."""
    (scanned, grads_scanned), scan_text = _loss_and_grads(unroll=False)
    (unrolled, grads_unrolled), unrolled_text = _loss_and_grads(unroll=True)
    assert float(unrolled) == pytest.approx(float(scanned), rel=1e-6)
    for a, b in zip(grads_unrolled, grads_scanned, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert len(hlo.loops(scan_text)) == 2 and not hlo.loops(unrolled_text)


def test_missing_cuda_plugin_and_bad_gpu_counts_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else find_spec(name, *a))
    with pytest.raises(UserError, match=r'pip install "jax\[cuda13\]"'):
        gpus.topology_devices("h100:1")
    with pytest.raises(UserError, match="1 to 8 GPUs"):
        gpus.parse_topology("h200:9")
    assert gpus.parse_topology("v5e:2x2") is None and gpus.parse_topology("h100:8")[1] == (8,)


def _h100_program(**overrides: int) -> tuple[Any, str]:
    """(memory analysis, HLO text) of the trainer's step for one compile-only H100: tests/helpers/tiny_config.py
    with the GPT-2 recipe's GPU settings (bf16, cuDNN attention, the loss 16 positions at a time) at 64 positions."""
    from jaxgpt.tools import aot
    from jaxgpt.train.config import from_config_dict

    c = load_tiny(workdir="aot", loss_chunk=16, batch_size=8, **overrides)
    c.model.update(vocab_size=512, block_size=64, n_head=2, dtype="bfloat16", attention_impl="auto")
    _, compiled = aot._compile(from_config_dict(c), aot.topology_devices("h100:1"))
    return compiled.memory_analysis(), compiled.as_text()


@needs_plugin
def test_the_recipes_h100_step_has_no_loop_and_moves_nothing_between_host_and_device() -> None:
    """configs/gpt2_124m.py's GPU step at a tiny size: no while loop (the chunked loss unrolled; one micro-batch),
    no host transfer or callback; every attention a cuDNN call (a forward and a backward per layer)."""
    _, text = _h100_program()
    facts = gpus.program_facts(text)
    assert facts["loops"] == [] and facts["host_transfers"] == []
    assert facts["launches"]["cuDNN"] == 4 and facts["launches"]["matmul"] > 0


@pytest.mark.slow
@needs_plugin
def test_gpt2_124m_at_batch_64_on_an_h100_has_no_loop_and_the_chunked_losss_memory() -> None:
    """The recipe itself, 64 x 1024 tokens on one H100 (about a minute here): no loop, nothing moved between host
    and device, and the temporaries of the chunked loss with the activations kept in bf16 (19.5 GiB when measured;
    28.6 with GELU's float32 intermediates kept; all logits at once: 24.7)."""
    from jaxgpt.tools import aot

    report = aot.analyze(_recipe(batch_size=64, grad_accum=1), "h100:1")
    assert report["gpu"]["loops"] == [] and report["gpu"]["host_transfers"] == []
    assert report["temp_bytes"] < 24 * 2**30 and report["fits"]


def _recipe(**overrides: int) -> Any:
    """configs/gpt2_124m.py, typed, with `overrides`."""
    from jaxgpt.train.config import from_config_dict

    spec = importlib.util.spec_from_file_location("gpt2_124m", ROOT / "configs" / "gpt2_124m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.update(overrides)
    return from_config_dict(c)


@needs_plugin
def test_the_unrolled_loss_keeps_the_scans_memory_bound_on_an_h100() -> None:
    """GPT-2's head and loss (8 x 1024 positions, 768 wide, 50304 logits) compiled for an H100: unrolled, the chunks
    run one after the other, so the temporaries stay within 10% of the scan's, far below all logits at once."""
    devices = gpus.topology_devices("h100:1")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    h = jax.ShapeDtypeStruct((8, 1024, 768), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((768, 50304), jnp.bfloat16, sharding=replicated)
    y = jax.ShapeDtypeStruct((8, 1024), jnp.int32, sharding=replicated)
    head = lambda w: lambda x: (x @ w).astype(jnp.float32)

    def temporaries(chunk: int, unroll: bool) -> int:
        loss = lambda h, w, y: chunked_cross_entropy(head(w), h, y, chunk, unroll=unroll)
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, y).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scanned, unrolled, whole = temporaries(128, False), temporaries(128, True), temporaries(1024, False)
    assert unrolled <= 1.1 * scanned and unrolled < 0.5 * whole, (scanned, unrolled, whole)


@needs_plugin
def test_aot_reports_an_h100_node(tmp_path: Path) -> None:
    """`jaxgpt aot --topology h100:8` on this CPU-only host: 8 compile-only H100s, data parallel; the report's GPU
    section (no loops, launches by kind, no host transfers) and the gradients' all-reduce over NVLink."""
    proc, r = aot_cli(tmp_path / "report.json", "--topology=h100:8", "--config.model.vocab_size=512",
                      "--config.model.dtype=bfloat16", "--config.model.attention_impl=auto", "--config.loss_chunk=16",
                      "--config.mesh.data=-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("8 x NVIDIA H100", "GPU program per step", "while loops             0", "host <-> device         none",
                 "cuDNN", "of NVLink per chip", "all-reduce"):
        assert text in proc.stdout, text
    assert r["mesh"]["data"] == 8 and r["gpu"]["launches"]["collective"] > 0 and r["t_collective"] > 0
    assert r["kernel_flops"] > 0 and any("cuDNN attention calls" in note for note in r["notes"])
