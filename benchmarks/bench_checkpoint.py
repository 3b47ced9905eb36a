"""Checkpoint save and restore of a GPT-2-124M-sized training state, to local disk and to object-storage servers.

    python benchmarks/bench_checkpoint.py            # GPT-2 124M: parameters + Adam moments, float32
    python benchmarks/bench_checkpoint.py --preset gpt2_6x6x384 --repeats 3

One run, the same state, the same code path training uses (`jaxgpt.io.checkpoint.Checkpointer`): local
disk, a GCS JSON-API server and an S3 server, both on 127.0.0.1 (tests/helpers/storage_servers.py starts them; they
keep objects in memory, in Python, so their numbers bound the client side from below rather than predict a
real bucket). "save" runs until the checkpoint is committed (orbax's asynchronous save, then its wait);
"blocking" is what the training loop waits for before its next step. "restore" reads the state back onto
one device. The last column stages dataset files (`jaxgpt.storage.stage`: download, sha256, rename),
how a run with data.dir in a bucket gets its tokens. Needs the test extra (moto, gcp-storage-emulator).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import storage_servers  # noqa: E402

from jaxgpt import storage  # noqa: E402
from jaxgpt.io.checkpoint import Checkpointer, state_bytes  # noqa: E402
from jaxgpt.model.gpt import init_params  # noqa: E402
from jaxgpt.model.presets import get_preset  # noqa: E402


def make_state(preset: str) -> dict:
    params = init_params(get_preset(preset), jax.random.key(0))
    opt_state = optax.adamw(1e-3).init(params)
    return {"params": params, "opt_state": opt_state, "step": np.int32(1)}


def time_round_trip(workdir: str, state: dict, repeats: int) -> tuple[float, float, float]:
    """Best of `repeats` (save until committed, blocking part of the save, restore) in seconds."""
    saves, blocks, restores = [], [], []
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0])), state)
    for r in range(repeats):
        ckpt = Checkpointer(workdir, keep=1, keep_best=False)
        step_state = {**state, "step": np.int32(r + 1)}
        t0 = time.perf_counter()
        ckpt.save(step_state, {"note": "benchmark"})
        blocks.append(time.perf_counter() - t0)
        ckpt.wait()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restored = ckpt.restore(r + 1, abstract)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t0)
        ckpt.close()
    return min(saves), min(blocks), min(restores)


def time_staging(target: str, local: Path, names: list[str], sha: dict[str, str]) -> float:
    where = storage.location(target, "target")
    storage.upload(local, where, names)
    os.environ["JAXGPT_CACHE"] = tempfile.mkdtemp()  # nothing staged yet
    t0 = time.perf_counter()
    storage.stage(where, names, sha)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stage_mb", type=int, default=256, help="dataset bytes to stage from each server")
    args = parser.parse_args()
    state = make_state(args.preset)
    mib = state_bytes([state["params"], state["opt_state"]]) / 2**20
    tmp = Path(tempfile.mkdtemp())
    shards = tmp / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    names, sha = [], {}
    for i in range(max(1, args.stage_mb // 64)):
        data = rng.integers(0, 50257, 32 * 2**20, dtype=np.uint16).tobytes()  # 64 MB
        names.append(f"train_{i:03d}.bin")
        (shards / names[-1]).write_bytes(data)
        sha[names[-1]] = hashlib.sha256(data).hexdigest()
    staged_mb = len(names) * 64
    print(f"state: {args.preset}, parameters + Adam moments, {mib:,.0f} MiB; best of {args.repeats}; "
          f"staging {staged_mb} MB of token files")
    print(f"{'where':<10}{'save (s)':>10}{'MiB/s':>8}{'blocking (s)':>14}{'restore (s)':>13}{'MiB/s':>8}"
          f"{'stage MB/s':>12}")
    rows = [("local", str(tmp / "run"), None)]
    servers = {scheme: storage_servers.start(scheme, str(tmp)) for scheme in ("gs", "s3")}
    rows += [(scheme, srv.url("bench"), srv) for scheme, srv in servers.items()]
    try:
        for name, workdir, srv in rows:
            env = srv.env(direct=True) if srv else {}
            os.environ.update(env)
            save, block, restore = time_round_trip(workdir, state, args.repeats)
            stage = f"{staged_mb / time_staging(srv.url('data'), shards, names, sha):>12,.0f}" if srv else f"{'-':>12}"
            print(f"{name:<10}{save:>10.2f}{mib / save:>8,.0f}{block:>14.2f}{restore:>13.2f}{mib / restore:>8,.0f}"
                  f"{stage}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()


if __name__ == "__main__":
    main()
