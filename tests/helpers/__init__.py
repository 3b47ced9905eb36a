"""Shared helpers for tests: the tiny config, a small corpus, the logged losses, device_check's smoke, and servers
on 127.0.0.1 (a free port, `jaxgpt serve` in a subprocess)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from jaxgpt.errors import UserError
from jaxgpt.storage import Location

ROOT = Path(__file__).resolve().parents[2]
TINY = Path(__file__).resolve().parent / "tiny_config.py"


def load_tiny(**overrides: object) -> ConfigDict:
    """tests/helpers/tiny_config.py with overrides; `data_dir` sets config.data.dir."""
    spec = importlib.util.spec_from_file_location("tiny_config", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    if "data_dir" in overrides:
        c.data.dir = overrides.pop("data_dir")
    for key, value in overrides.items():
        c[key] = value
    return c


def fake_devices_env(count: int) -> dict[str, str]:
    """A subprocess's environment with `count` CPU devices (a flag read when jax starts), keeping the suite's
    other XLA flags (conftest's optimisation level)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def prepare_test_corpus(out: Path) -> Path:
    """~150k characters of real Python source, char-level: enough for train and val splits of block 32.

    Any stdlib modules will do; their text is stable for a given interpreter.
    """
    from json import decoder, encoder

    from jaxgpt.data.prepare import prepare_text

    sources = [Path(m.__file__).read_text() for m in (decoder, encoder, signal, subprocess)]
    prepare_text(sources, out, None, 0.1, "test sources", False)
    return out


def write_hellaswag_fixture(path: Path, n: int, seed: int = 8) -> Path:
    """A HellaSwag-format JSONL of `n` examples spelled with characters the test corpus's vocabulary has."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["def", "self", "return", "import", "class", "value", "None", "for", "in", "if", "else", "list"]
    phrase = lambda k: " ".join(rng.choice(words, k))
    examples = [{"ctx": phrase(4), "endings": [phrase(int(rng.integers(1, 3))) for _ in range(4)],
                 "label": int(rng.integers(0, 4))} for _ in range(n)]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def logged_records(workdir: Location) -> list[dict]:
    """Every record of a run's metrics.jsonl (a local or a bucket work directory), in the order written (resumes
    included, as the file has them)."""
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def logged_eval(workdir: Location, key: str) -> list[tuple[int, float]]:
    """(step, value) of every evaluation record of a run's metrics.jsonl that has `key`."""
    return [(r["step"], r[key]) for r in logged_records(workdir) if key in r]


def logged_losses(workdir: Location) -> list[tuple[int, float]]:
    """(step, train loss) of every periodic record in a run's metrics.jsonl, in the order written."""
    return [(r["step"], r["train_loss"]) for r in logged_records(workdir) if "lr" in r]


def user_error_line(fn: Callable[..., object], *args: object, **kwargs: object) -> str:
    """The message of the UserError `fn(*args, **kwargs)` raises, checked to be one line."""
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def one_line_error(proc: subprocess.CompletedProcess | tuple[int, str], status: int = 2) -> str:
    """The single error line of a refused command, a finished process or its (status, stderr) (asserting the
    status, exactly one error line and no traceback)."""
    code, err = (proc.returncode, proc.stderr) if isinstance(proc, subprocess.CompletedProcess) else proc
    assert code == status, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def train_run(c: ConfigDict) -> dict:
    """The loop on a ConfigDict, typed at the boundary as the train command does."""
    from jaxgpt.tasks import build
    from jaxgpt.train.config import from_config_dict
    from jaxgpt.train.loop import train

    return train(from_config_dict(c), build)


def offline_train_error(tmp_path: Path, *flags: str) -> str:
    """The one error line of `jaxgpt train` with `flags` run where the Hugging Face Hub cannot be reached (offline,
    an empty cache in `tmp_path`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "jaxgpt", "train", *flags], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    return one_line_error(proc)


def device_check_smoke(out: Path, *options: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`benchmarks/device_check.py --smoke` with `options`, writing its JSON to `out`: the finished process (its
    output captured) and the JSON, None where the run wrote none."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--smoke", *options,
                           "--out", str(out)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, json.loads(out.read_text()) if out.exists() else None


def aot_cli(out: Path, *options: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`jaxgpt aot` with `options` (tests/helpers/tiny_config.py unless they name a config), its report's JSON
    written to `out`: the finished process (its output captured) and the report, None where it wrote none."""
    config = [] if any(o.startswith("--config=") for o in options) else [f"--config={TINY}"]
    proc = subprocess.run(["timeout", "600", sys.executable, "-m", "jaxgpt", "aot", *config, *options,
                           f"--json={out}"], capture_output=True, text=True, cwd=ROOT, timeout=660)
    return proc, json.loads(out.read_text()) if out.exists() else None


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (the system's pick), for a server a test or benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*options: str, log: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """`jaxgpt serve` of this checkout with `options` on a free port of 127.0.0.1, in a subprocess: (the process,
    its URL) once GET /health answers, terminated on leaving (unless the caller ended it).

    Its stderr goes to `log` and its stdout nowhere, so a test can read what it reported; with no `log` both stay
    this process's (a benchmark's terminal). `env` adds variables. A server that exits or does not answer within
    `timeout` seconds (jax's start and the model's compilation come first) is a RuntimeError with its log.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jaxgpt", "serve", f"--port={port}", *options]
    with log.open("w") if log is not None else contextlib.nullcontext() as err:  # the child keeps its own copy
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                stdout=None if log is None else subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.time() + timeout
        while not answers(f"{url}/health"):
            if proc.poll() is not None or time.time() > deadline:
                why = (f"did not answer /health within {timeout} s" if proc.returncode is None else
                       f"exited with status {proc.returncode}")
                raise RuntimeError(f"`{' '.join(command)}` {why}" + ("" if log is None else f"\n{log.read_text()}"))
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def answers(url: str) -> bool:
    """Whether GET `url` answers 200 (a server still starting refuses the connection)."""
    import httpx  # the serve extra, which not every test environment has

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False

def gauges(url: str) -> tuple[float, float]:
    """The queue depth and busy slots a front end reports."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    values = {sample.name: sample.value for family in families for sample in family.samples}
    return values["jaxgpt_queue_depth"], values["jaxgpt_busy_slots"]
