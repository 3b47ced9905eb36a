"""Shared helpers for tests that train: the tiny config, a small corpus, and the logged losses."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path

from ml_collections import ConfigDict

TINY = Path(__file__).resolve().parent / "tiny_config.py"


def load_tiny(**overrides: object) -> ConfigDict:
    """tests/tiny_config.py with overrides; `data_dir` sets config.data.dir."""
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


def logged_eval(workdir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every evaluation record of a run's metrics.jsonl that has `key`."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def logged_losses(workdir: Path) -> list[tuple[int, float]]:
    """(step, train loss) of every periodic record in a run's metrics.jsonl, in the order written."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"]) for r in rows if "lr" in r]


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
    from jaxgpt.train.config import from_config_dict
    from jaxgpt.train.loop import train

    return train(from_config_dict(c))
