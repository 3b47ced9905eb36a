"""Runs, datasets and exports in gs:// and s3:// buckets, against real storage servers on 127.0.0.1.

Each scheme's server (tests/helpers/storage_servers.py) runs for the module; trainers are subprocesses that reach
it through a proxy the tests can cut, as a storage server that goes away mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flax import traverse_util
from helpers import ROOT, TINY, logged_losses, one_line_error, storage_servers
from helpers.runs import run as run_command

STEPS = ["--config.max_steps=30", "--config.ckpt_interval=10", "--config.eval_interval=30",
         "--config.optim.decay_steps=1000"]


def one_by_default(default: str) -> pytest.MarkDecorator:
    """Both schemes, the heavier tests' second one among the slow tests (`-m slow`) to keep the default run lean."""
    other = {"gs": "s3", "s3": "gs"}[default]
    return pytest.mark.parametrize("server", [default, pytest.param(other, marks=pytest.mark.slow)], indirect=True)


@pytest.fixture(scope="module", params=["gs", "s3"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    srv = storage_servers.start(request.param, str(tmp_path_factory.mktemp(request.param)))
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))  # staged files and mirrors: per test


def train_cmd(workdir: str, data_dir: str | Path, xla: str, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"--config={TINY}", f"--config.workdir={workdir}",
            f"--config.data.dir={data_dir}", f"--config.compilation_cache_dir={xla}", *STEPS, *extra]


def run(cmd: list[str], server: storage_servers.Server, **env: str) -> subprocess.CompletedProcess:
    return run_command(cmd, env={**os.environ, **server.env(), **env})


def popen(cmd: list[str], server: storage_servers.Server, **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **server.env(), **env})


def wait_for(proc: subprocess.Popen, needle: str) -> str:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError("".join(seen)[-3000:])


def params_at(workdir: str, step: int) -> dict:
    from jaxgpt.io.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir, read_only=True)
    try:
        assert ckpt.latest_step() == step
        return traverse_util.flatten_dict(ckpt.restore_params(step))
    finally:
        ckpt.close()


def losses(workdir: str) -> list[tuple[int, float]]:
    from jaxgpt import storage

    return logged_losses(storage.location(workdir, "workdir"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, xla_cache: str) -> Path:
    """The uninterrupted run, on local disk."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    proc = subprocess.run(train_cmd(str(workdir), data_dir, xla_cache), capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def kill_mid_save(server: storage_servers.Server, url: str, cmd: list[str]) -> tuple[list[int], list[str]]:
    """SIGKILL the run while its step-20 checkpoint is being written: the moment its directory appears in the
    bucket (step 10 is committed by then: orbax finishes a save before it starts the next). Returns the
    committed steps and the directories left without a commit."""
    from jaxgpt import storage
    from jaxgpt.io.checkpoint import Checkpointer

    proc = popen(cmd, server)
    wait_for(proc, "step 20/")
    steps = storage.location(url, "workdir") / "checkpoints"
    deadline = time.monotonic() + 60
    while not (steps / "20").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = [p.name for p in steps.iterdir() if not (p / "commit_success.txt").exists()]
    return Checkpointer(url, read_only=True).all_steps(), partial


@one_by_default("gs")
def test_sigkill_mid_save_then_resume_equals_the_uninterrupted_run(server: storage_servers.Server, data_dir: Path,
                                                                   xla_cache: str, straight: Path,
                                                                   tmp_path: Path) -> None:
    with storage_servers.client_env(server):
        for _ in range(3):  # a save that commits before the kill lands is tried again on a new path
            url = server.url()
            committed, partial = kill_mid_save(server, url, train_cmd(url, data_dir, xla_cache))
            if partial:
                break
    assert committed == [10] and partial == ["20"], (committed, partial)  # the half-written step is not listed
    resumed = run(train_cmd(url, data_dir, xla_cache), server)
    assert resumed.returncode == 0 and f"resuming at step {committed[-1]}" in resumed.stdout, resumed.stderr[-3000:]
    with storage_servers.client_env(server):
        want, got = params_at(str(straight), 30), params_at(url, 30)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
        assert losses(url) == losses(str(straight))  # metrics.jsonl in the bucket: one row per logged step
    for command in (["plots", "curves", f"--workdir={url}", f"--out={tmp_path / 'curves.png'}"],
                    ["eval", f"--workdir={url}"]):  # the other readers of a run, on the bucket
        proc = run([sys.executable, "-m", "jaxgpt", *command], server)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 0 and "val" in proc.stdout


def test_two_trainers_on_one_path_one_runs_and_sigterm_commits(server: storage_servers.Server, data_dir: Path,
                                                                xla_cache: str) -> None:
    url = server.url()
    first = popen(train_cmd(url, data_dir, xla_cache, "--config.max_steps=100000", "--config.ckpt_interval=1000",
                            "--config.eval_interval=100000"), server)
    try:
        wait_for(first, "step 5/")
        line = one_line_error(run(train_cmd(url, data_dir, xla_cache), server))
        assert "in use by another training process" in line and f"PID {first.pid}" in line, line
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
        stopped = one_line_error((first.returncode, err), status=128 + signal.SIGTERM)
        step = int(stopped.split(" at step ")[1].split(";")[0])
    finally:
        first.kill()
    with storage_servers.client_env(server):
        from jaxgpt import storage
        from jaxgpt.io.checkpoint import Checkpointer

        assert Checkpointer(url, read_only=True).latest_step() == step  # committed before the exit
        assert not (storage.location(url, "workdir") / "jaxgpt.lease").exists()  # released


def test_a_lease_not_renewed_for_its_period_is_taken_over(server: storage_servers.Server, data_dir: Path,
                                                          xla_cache: str) -> None:
    url = server.url()
    with storage_servers.client_env(server):
        from jaxgpt import storage

        lease = {"holder": "dead", "host": "gone-host", "pid": 4242, "since": time.time() - 600,
                 "renewed": time.time() - 120, "period": 60}
        storage.write_text(storage.location(url, "workdir") / "jaxgpt.lease", json.dumps(lease))
    proc = run(train_cmd(url, data_dir, xla_cache, "--config.max_steps=10"), server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "taking over" in proc.stderr and "gone-host" in proc.stderr


@pytest.mark.parametrize("scheme", ["s3", pytest.param("gs", marks=pytest.mark.slow)])
def test_storage_going_away_is_one_line_and_keeps_the_last_checkpoint(scheme: str, data_dir: Path, xla_cache: str,
                                                                      tmp_path: Path) -> None:
    srv = storage_servers.start(scheme, str(tmp_path))  # its own server: this test cuts it off
    try:
        url = srv.url()
        proc = popen(train_cmd(url, data_dir, xla_cache, "--config.max_steps=100000", "--config.eval_interval=100000",
                               "--config.lease_seconds=6"), srv, JAXGPT_STORAGE_RETRIES="2")
        wait_for(proc, "step 25/")  # steps 10 and 20 are committed
        srv.proxy.cut()
        started = time.time()
        _, err = proc.communicate(timeout=240)
        line = one_line_error((proc.returncode, err))
        assert url in line and "cannot be reached" in line, line
        print(f"{scheme}: stopped {time.time() - started:.1f} s after the server went away: {line}")
        sample = subprocess.run([sys.executable, str(ROOT / "sample.py"), f"--workdir={url}", "--prompt=def ",
                                 "--max_new_tokens=8"], capture_output=True, text=True, cwd=ROOT,
                                env={**os.environ, **srv.env(direct=True)})
        assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-3000:]
    finally:
        srv.stop()


@one_by_default("s3")
def test_dataset_prepared_into_a_bucket_trains_like_the_local_one(server: storage_servers.Server, data_dir: Path,
                                                                  xla_cache: str, tmp_path: Path) -> None:
    texts = [str(p) for p in sorted((ROOT / "jaxgpt" / "train").glob("*.py"))]
    local, remote = tmp_path / "data", server.url("data")
    for out in (str(local), remote):
        proc = run([sys.executable, "-m", "jaxgpt", "data", "--text", *texts, "--tokenizer=char", f"--out={out}"],
                   server)
        assert proc.returncode == 0, proc.stderr[-3000:]
    again = run([sys.executable, "-m", "jaxgpt", "data", "--text", texts[-1], "--tokenizer=char", f"--out={remote}"],
                server)
    assert "already holds a different dataset" in one_line_error(again)
    runs = {}
    for name, data in (("local", str(local)), ("bucket", remote)):
        runs[name] = server.url(name)
        proc = run(train_cmd(runs[name], data, xla_cache, "--config.max_steps=10"), server)
        assert proc.returncode == 0, proc.stderr[-3000:]
    with storage_servers.client_env(server):
        assert losses(runs["bucket"]) == losses(runs["local"]) and len(losses(runs["local"])) == 2


def test_bad_locations_are_one_line(server: storage_servers.Server, data_dir: Path, xla_cache: str) -> None:
    missing = f"{server.scheme}://no-such-bucket/run"
    assert "the bucket does not exist" in one_line_error(run(train_cmd(missing, data_dir, xla_cache), server))
    other = one_line_error(run(train_cmd("http://example.com/run", data_dir, xla_cache), server))
    assert "http:// is not a supported location" in other
    if server.scheme == "s3":
        keyless = {k: "" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        env = {**os.environ, **{k: v for k, v in server.env().items() if k not in keyless},
               "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
        env = {k: v for k, v in env.items() if k not in keyless}
        proc = subprocess.run(train_cmd(server.url(), data_dir, xla_cache), capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)
        assert "no credentials" in one_line_error(proc)


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """One process with four CPU devices, on local disk: what the two-process runs must equal."""
    from helpers.multihost import MESH, finish, start

    logs = tmp_path_factory.mktemp("ref")
    assert finish([start(logs / "run", data_dir, 4, *MESH, log=logs / "ref")]) == [0], (logs / "ref.err").read_text()
    return logs / "run"


@pytest.mark.slow  # (two trainers and a four-device reference: about 35 s per scheme)
def test_two_processes_write_one_sharded_checkpoint_that_one_device_restores(
        server: storage_servers.Server, data_dir: Path, four_devices: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.multihost import MESH, final_params, finish, start_pair

    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    url = server.url()
    codes = finish(start_pair(url, data_dir, *MESH, logs=tmp_path))
    assert codes == [0, 0], [(tmp_path / f"p{i}.err").read_text()[-2000:] for i in (0, 1)]
    with storage_servers.client_env(server):
        want, got = final_params(four_devices), final_params(url)  # restored onto this process's one device
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-4, err_msg=str(k))


@pytest.mark.torch
@pytest.mark.slow
def test_hugging_face_export_to_a_bucket_and_back(server: storage_servers.Server, data_dir: Path, xla_cache: str,
                                                  straight: Path) -> None:
    pytest.importorskip("transformers")  # writing the tokenizer of an export needs it
    out = server.url("export")
    proc = run([sys.executable, "-m", "jaxgpt", "hf", "export", f"--workdir={straight}", f"--out={out}"], server)
    assert proc.returncode == 0 and f"wrote {out}" in proc.stdout, proc.stderr[-3000:]
    again = run([sys.executable, "-m", "jaxgpt", "hf", "export", f"--workdir={straight}", f"--out={out}"], server)
    assert "exists and is not empty" in one_line_error(again)
    texts = {}
    for source in (f"--workdir={straight}", f"--init_from=hf:{out}"):
        proc = run([sys.executable, str(ROOT / "sample.py"), source, "--prompt=def ", "--max_new_tokens=12",
                    "--temperature=0"], server)
        assert proc.returncode == 0, proc.stderr[-3000:]
        texts[source] = proc.stdout
    assert len(set(texts.values())) == 1, texts  # the bucket's export generates what the run generates
