"""Corpus-scale data through the commands: `jaxgpt data` killed mid-preparation resumes to the uninterrupted
output, and llm.c's token shards train and resume bit-exact in train.py (tests/unit/data/test_corpus.py has the
rest, in this process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from helpers import ROOT
from helpers.corpus import corpus, llmc_shard, shard_bytes
from helpers.runs import final_params, run_train, train_cmd, train_losses

from jaxgpt.data.dataset import load_dataset


def test_kill_mid_preparation_then_the_same_command_gives_the_uninterrupted_output(tmp_path, gpt2):
    files = corpus(tmp_path / "text", n_files=2, words=600_000)
    command = [sys.executable, "-m", "jaxgpt", "data", "--text", *map(str, files), "--tokenizer", "gpt2",
               "--workers", "1", "--shard_tokens", "50000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([*command, "--out", str(tmp_path / "straight")], check=True, env=env, timeout=300,
                   capture_output=True)
    out, progress = tmp_path / "killed", tmp_path / ".killed.preparing" / "progress.jsonl"
    proc = subprocess.Popen([*command, "--out", str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (progress.exists() and len(progress.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "preparation ended before two shards"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    resumed = subprocess.run([*command, "--out", str(out)], env=env, timeout=300, capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming: " in resumed.stderr, resumed.stderr[-2000:]
    straight_meta = json.loads((tmp_path / "straight" / "meta.json").read_text())
    assert json.loads((out / "meta.json").read_text())["shards"] == straight_meta["shards"]
    assert {k: v for k, v in shard_bytes(out).items() if k != "meta.json"} == {
        k: v for k, v in shard_bytes(tmp_path / "straight").items() if k != "meta.json"}
    assert not (tmp_path / ".killed.preparing").exists()


def test_llmc_shards_train_and_resume_bit_exact(tmp_path, xla_cache):
    rng = np.random.default_rng(0)
    data = tmp_path / "fineweb10B"
    data.mkdir()
    for name, n in [("fineweb_val_000000.bin", 3_000), ("fineweb_train_000001.bin", 5_000),
                    ("fineweb_train_000002.bin", 4_000)]:
        llmc_shard(data / name, rng.integers(0, 50257, n))
    ds = load_dataset(data)
    assert (len(ds.train), len(ds.val), ds.meta["vocab_size"]) == (9_000, 3_000, 50257)
    steps = ["--config.max_steps=20", "--config.optim.decay_steps=20", "--config.ckpt_interval=10",
             "--config.eval_interval=10", "--config.batch_size=4"]
    run_train(*train_cmd(tmp_path / "straight", data, xla_cache, *steps))
    run_train(*train_cmd(tmp_path / "halves", data, xla_cache, *steps, "--config.max_steps=10"))
    resumed = run_train(*train_cmd(tmp_path / "halves", data, xla_cache, *steps))
    assert "resuming at step 10" in resumed.stdout
    want, got = final_params(tmp_path / "straight"), final_params(tmp_path / "halves")
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
    assert train_losses(tmp_path / "halves") == train_losses(tmp_path / "straight")
