"""Multi-host training on one machine: two processes x two CPU devices, talking over gloo.

Every child runs under `timeout`, on a random free port, with short initialization and heartbeat
timeouts, so a broken run fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY, logged_eval, logged_losses, write_hellaswag_fixture
from helpers.multihost import MESH, STEPS, final_params, finish, kill_all, start, start_pair

from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.train import sharding as layout

TOL = 1e-5


def test_two_processes_equal_one_process_with_four_devices(tmp_path: Path, data_dir: Path) -> None:
    mesh = [*MESH, "--config.eval.hellaswag=True",
            f"--config.eval.hellaswag_data={write_hellaswag_fixture(tmp_path / 'hellaswag.jsonl', 10)}"]
    ref = start(tmp_path / "ref", data_dir, 4, *mesh, log=tmp_path / "ref")
    pair = start_pair(tmp_path / "multi", data_dir, *mesh, logs=tmp_path)
    codes = finish([ref, *pair])
    err = {name: (tmp_path / f"{name}.err").read_text() for name in ("ref", "p0", "p1")}
    assert codes == [0, 0, 0], {k: v[-2000:] for k, v in err.items()}

    want, got = logged_losses(tmp_path / "ref"), logged_losses(tmp_path / "multi")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # one writer: every step logged exactly once
    diffs = [abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)]
    print(f"2 processes x 2 devices vs 1 x 4: max |loss diff| = {max(diffs):.2e}")
    assert max(diffs) < TOL, diffs
    # HellaSwag during training: each host scores the rows its devices hold; both runs pick the same endings.
    assert logged_eval(tmp_path / "multi", "hellaswag_acc_norm") == logged_eval(tmp_path / "ref", "hellaswag_acc_norm")
    assert len(logged_eval(tmp_path / "ref", "hellaswag_acc_norm")) == 1

    # Only process 0 prints (gloo's C++ library prints its connection lines itself, on both).
    out0, out1 = (tmp_path / "p0.out").read_text(), (tmp_path / "p1.out").read_text()
    assert "model:" in out0 and "throughput" in out0 and "[Gloo] Rank 0" in out0
    # gloo's threads print their lines unsynchronized, so one line's words can land inside another's: process 1
    # may print nothing but those words and rank numbers.
    gloo = {"[Gloo]", "Rank", "is", "connected", "to", "peer", "ranks.", "Expected", "number", "of", "ranks", ":"}
    assert all(word in gloo or word.isdigit() for word in out1.split()), out1[-2000:]
    assert "[Gloo]" in out1 and "step/s" not in err["p1"]  # no progress bar either

    # The checkpoint both processes wrote together restores here, on one device, to the same values.
    assert Checkpointer(tmp_path / "multi", read_only=True).manager.all_steps() == [5, 10]
    ref_params, multi_params = final_params(tmp_path / "ref"), final_params(tmp_path / "multi")
    assert ref_params.keys() == multi_params.keys()
    for k in ref_params:
        np.testing.assert_allclose(np.asarray(multi_params[k]), np.asarray(ref_params[k]), atol=1e-4, err_msg=str(k))


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["worker", "coordinator"])
def test_killed_peer_makes_survivor_exit_nonzero(tmp_path: Path, data_dir: Path, victim: int) -> None:
    endless = ["--config.max_steps=100000", "--config.eval_interval=100000", "--config.ckpt_interval=100000"]
    procs = start_pair(tmp_path / "w", data_dir, *endless, logs=tmp_path, heartbeat=5, seconds=300)
    try:
        metrics = tmp_path / "w" / "metrics.jsonl"
        deadline = time.monotonic() + 200
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()[-2000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        killed_at = time.monotonic()
        os.killpg(procs[victim].pid, signal.SIGKILL)
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        kill_all(procs)
    print(f"killed process {victim}: the survivor exited with {code} after {elapsed:.1f} s")
    assert code not in (0, 124), f"survivor exited with {code}"  # 124: `timeout` had to stop it
    assert elapsed < 30, f"survivor needed {elapsed:.1f} s to notice"


@pytest.mark.skipif(__import__("importlib").util.find_spec("libtpu") is None, reason="needs libtpu's topologies")
def test_each_host_reads_only_the_rows_its_devices_hold() -> None:
    """Row ranges per host on a 16-chip, 4-host v5e slice, for rows split over 16, 4 and 1 (replicated) groups."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxgpt.tools import aot

    devices = aot.topology_devices("v5e:4x4")
    hosts = sorted({d.process_index for d in devices})
    assert len(hosts) == 4
    shape = (2, 64, 32)  # (micro-batches, rows, tokens)
    # (16,1,1): 4 rows per chip, 4 chips per host. (1,4,4): 4 row groups of 16; the physical layout puts each
    # host's 4 chips in two of them (a tensor group spans two hosts). (1,1,16): rows replicated, all 64.
    for mesh_shape, rows_per_host in [((16, 1, 1), 16), ((1, 4, 4), 32), ((1, 1, 16), 64)]:
        mesh = layout.make_mesh(mesh_shape, devices)
        sh = NamedSharding(mesh, PartitionSpec(None, layout.BATCH_AXES, None))
        spans = {h: layout.local_rows(sh, shape, dim=1, process_index=h) for h in hosts}
        for h in hosts:
            assert sum(b - a for a, b in spans[h]) == rows_per_host, (mesh_shape, spans)
            for d, index in sh.devices_indices_map(shape).items():  # every row a host's device needs is read
                if d.process_index == h:
                    start, stop, _ = index[1].indices(64)
                    assert any(a <= start and stop <= b for a, b in spans[h]), (mesh_shape, h, spans)
        assert sorted({r for h in hosts for a, b in spans[h] for r in range(a, b)}) == list(range(64))


def test_read_rows_takes_one_block_or_gathers_spans() -> None:
    calls = []

    def read(i: int, n: int) -> tuple[np.ndarray]:
        calls.append((i, n))
        rows = np.arange(16)[i * 16 // n:(i + 1) * 16 // n]
        return (rows,)

    (rows,) = layout.read_rows(read, [(2, 3)], n_rows=16, unit=4)  # rows 8..11: "process 2 of 4"
    assert calls == [(2, 4)] and rows.tolist() == [8, 9, 10, 11]
    calls.clear()
    (rows,) = layout.read_rows(read, [(0, 1), (3, 4)], n_rows=16, unit=4)  # two spans: read all, keep both
    assert calls == [(0, 1)] and rows.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_distributed_without_a_cluster_is_a_one_line_error(tmp_path: Path, data_dir: Path) -> None:
    """Nothing to auto-detect and no coordinator given: a message naming the keys, not a traceback."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for key in ("SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri"):
        env.pop(key, None)
    proc = subprocess.run(["timeout", "120", sys.executable, str(ROOT / "train.py"), f"--config={TINY}",
                           f"--config.workdir={tmp_path / 'w'}", f"--config.data.dir={data_dir}",
                           "--config.distributed.enabled=True"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=150)
    assert proc.returncode == 2 and "config.distributed.coordinator_address" in proc.stderr
    assert "Traceback" not in proc.stderr
