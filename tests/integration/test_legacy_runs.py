"""Run directories written by earlier versions (tests/data/legacy_runs, README there) still sample exactly what they
sampled then, and resume training where they stopped: an LM and a seq2seq run from before the package redesign, and
an RL run from before RL's prompts moved to config.rl and chat.tasks became chat.datasets (`jaxgpt.train.renamed`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, logged_records
from helpers.runs import run

LEGACY = ROOT / "tests" / "data" / "legacy_runs"
# run -> the sample.py arguments of each recorded output (README.md; the LM greedy file holds 30 tokens, which
# is what sample.py at the recording commit prints with --max_new_tokens 30)
SAMPLES = {
    "lm": {"lm_sample_t1_seed0.txt": ["--prompt", "def ", "--max_new_tokens", "40", "--temperature", "1.0"],
           "lm_greedy.txt": ["--prompt", "def ", "--max_new_tokens", "30", "--temperature", "0"]},
    "seq2seq": {"seq2seq_sample_t1_seed0.txt": ["--source", "ageb", "--temperature", "1.0"],
                "seq2seq_greedy.txt": ["--source", "ageb", "--temperature", "0"]},
    "rl": {"rl_chat_sample_t1_seed0.txt": ["--chat", "--max_new_tokens", "8", "--temperature", "1.0"],
           "rl_chat_greedy.txt": ["--chat", "--max_new_tokens", "8", "--temperature", "0"]},
}
CHAT_INPUT = "What is 2 + 3?\nReverse abc\n"  # the user turns the RL run's recorded replies answer, one a line
BASE_RUN = {"rl": "rl_base"}  # a run another one starts from (init_from), copied beside it
# A config file that is the legacy run's config.json: resuming must see the same trajectory settings.
CONFIG_FILE = '''import json
from jaxgpt.train.config import base_config


def _apply(node, values):
    for key, value in values.items():
        if isinstance(value, dict):
            _apply(node[key], value)
        elif value is not None:
            node[key] = value


def get_config():
    c = base_config()
    _apply(c, json.load(open({path!r})))
    return c
'''


def _copy(tmp_path: Path, run: str) -> Path:
    """The run and its data in tmp_path, its config.json pointing there (it names the paths it was written at)."""
    shutil.copytree(LEGACY / "data", tmp_path / "data")
    workdir = tmp_path / run
    shutil.copytree(LEGACY / run, workdir)
    settings = json.loads((workdir / "config.json").read_text())
    settings["workdir"], settings["data"]["dir"] = str(workdir), str(tmp_path / "data")
    if run in BASE_RUN:
        shutil.copytree(LEGACY / BASE_RUN[run], tmp_path / BASE_RUN[run])
        settings["init_from"] = f"workdir:{tmp_path / BASE_RUN[run]}"
    (workdir / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return workdir


def _run(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, *args], cwd=cwd, input=stdin, check=True)


@pytest.mark.parametrize("run", sorted(SAMPLES))
def test_legacy_run_samples_the_recorded_text(tmp_path: Path, run: str) -> None:
    workdir = _copy(tmp_path, run)
    for recorded, args in SAMPLES[run].items():
        proc = _run(str(ROOT / "sample.py"), "--workdir", str(workdir), "--seed", "0", *args, cwd=tmp_path,
                    stdin=CHAT_INPUT if "--chat" in args else None)
        assert proc.stdout == (LEGACY / recorded).read_text(), recorded


@pytest.mark.parametrize("run", sorted(SAMPLES))
def test_legacy_run_resumes_training(tmp_path: Path, run: str) -> None:
    workdir = _copy(tmp_path, run)
    config = tmp_path / "legacy_config.py"
    config.write_text(CONFIG_FILE.format(path=str(workdir / "config.json")))
    proc = _run(str(ROOT / "train.py"), f"--config={config}", "--config.max_steps=6", "--config.ckpt_interval=2",
                cwd=tmp_path)
    assert "resuming at step 4" in proc.stdout + proc.stderr
    if run == "rl":  # its prompts, configured under chat then, are read as config.rl's, saying so once
        assert proc.stderr.count("warning: RL's prompts are configured under config.rl now: read config.chat."
                                 "{datasets,examples,val_fraction} as config.rl.{datasets,examples,val_fraction}") == 1
        assert "built-in conversations: 200 of arithmetic, reverse (seed 0): 171 training / 29 held-out" in proc.stdout
    rows = logged_records(workdir)
    assert max(row["step"] for row in rows) == 6
    assert (workdir / "checkpoints" / "6").is_dir()
