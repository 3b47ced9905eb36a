"""The command layer: one parser style for every command, one-line errors, and the loop's task interface."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY

from jaxgpt import commands
from jaxgpt.commands import train as train_command


@pytest.mark.parametrize("name", sorted(commands.COMMANDS))
def test_every_command_has_help(name: str, capsys: pytest.CaptureFixture) -> None:
    assert commands.dispatch(["jaxgpt", name, "--help"]) == 0
    assert "--" in capsys.readouterr().out  # its flags are listed


def test_unknown_command_lists_the_commands(capsys: pytest.CaptureFixture) -> None:
    assert commands.dispatch(["jaxgpt", "trian"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in commands.COMMANDS)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "--config is required"),
    (["--config", str(ROOT / "configs" / "missing.py")], "cannot load the --config file"),
    ([f"--config={TINY}", "--config.optim.lrr=1"], "unknown config key lrr"),
    ([f"--config={TINY}", "--config.max_steps=many"], "config.max_steps=many"),
    ([f"--config={TINY}", "stray"], "unexpected arguments"),
])
def test_config_mistakes_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert train_command.main(["train.py", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_a_config_that_returns_the_wrong_type_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bad.py").write_text("def get_config():\n    return {'workdir': 'x'}\n")
    assert train_command.main(["train.py", f"--config={tmp_path / 'bad.py'}"]) == 2
    assert "returned a dict, not an ml_collections ConfigDict" in capsys.readouterr().err


def test_python_dash_m_jaxgpt_runs_a_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "jaxgpt", "summary", "--preset", "seed004"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "Total params" in proc.stdout, proc.stderr[-2000:]






@pytest.mark.parametrize(("body", "message"), [
    ("def get_config(:\n    pass\n", "invalid syntax"),
    ("def get_config():\n    return [1]\n", "get_config() returned a list"),
    ("def get_config():\n    return None\n", "get_config() returned None"),
    ("x = 1\n", "defines no get_config()"),
])
@pytest.mark.parametrize("command", ["train", "summary"])
def test_every_command_loads_config_files_alike(command: str, body: str, message: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """train and summary load --config through one loader: each broken file is one line, never a traceback."""
    path = tmp_path / f"{command}_config.py"
    path.write_text(body)
    assert commands.dispatch(["jaxgpt", command, f"--config={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


URL = "ftp://host/x"  # a scheme no client reads: once the local directory "ftp:/host/x"
TRAIN = ["train", f"--config={TINY}", "--config.data.name=", "--config.data.dir=data", "--config.workdir=w"]
TRAIN_KEYS = [("workdir", URL), ("data.dir", URL), ("init_from", f"hf:{URL}"), ("init_from", f"workdir:{URL}"),
              ("data.bpe_file", URL), ("data.csv", URL), ("compilation_cache_dir", URL),
              ("eval.hellaswag_data", URL), ("classify.data", URL), ("seq2seq.data", URL)]
LOCATION_FLAGS = [
    *[([*TRAIN, f"--config.{key}={value}"], f"config.{key}") for key, value in TRAIN_KEYS],
    *[(["sample", f"--{flag}={value}", *(["--workdir=w"] if flag not in ("workdir", "init_from") else [])], f"--{flag}")
      for flag, value in [("workdir", URL), ("init_from", f"hf:{URL}"), ("bpe_file", URL), ("prompt_file", URL),
                          ("source_file", URL)]],
    (["serve", f"--workdir={URL}"], "--workdir"),
    (["serve", f"--init_from=hf:{URL}"], "--init_from"),
    (["data", "--text=a.txt", f"--out={URL}"], "--out"),
    (["data", f"--text={URL}", "--out=ds"], "--text"),
    (["data", "--text=a.txt", URL, "--out=ds"], "--text"),  # the files after the first, as arguments
    (["data", "--dataset=wine_reviews", f"--csv={URL}", "--out=ds"], "--csv"),
    (["data", "--text=a.txt", "--tokenizer=gpt2", f"--bpe_file={URL}", "--out=ds"], "--bpe_file"),
    (["hf", "inspect", URL], "`hf inspect` PATH"),
    (["hf", "export", f"--workdir={URL}", "--out=export"], "--workdir"),
    (["hf", "export", "--workdir=w", f"--out={URL}"], "--out"),
    (["hf", "export", "--workdir=w", "--out=export", f"--bpe_file={URL}"], "--bpe_file"),
    (["eval", f"--workdir={URL}"], "--workdir"),
    (["eval", f"--init_from=hf:{URL}"], "--init_from"),
    (["eval", "--workdir=w", f"--text={URL}"], "--text"),
    (["eval", "--workdir=w", "--text=a.txt", URL], "--text"),
    (["eval", "--workdir=w", f"--data_dir={URL}"], "--data_dir"),
    (["eval", "--workdir=w", "--benchmark=hellaswag", f"--data={URL}"], "--data"),
    (["eval", "--workdir=w", f"--bpe_file={URL}"], "--bpe_file"),
    (["bpe", "fetch", f"--dest={URL}"], "--dest"),
    (["plots", "curves", f"--workdir={URL}", "--out=c.png"], "--workdir"),
    (["plots", "curves", "--workdir=w", f"--out={URL}"], "--out"),
    (["plots", "attention", f"--hf={URL}", "--ids=1", "--layer=0", "--out=a.png"], "--hf"),
    (["plots", "attention", "--workdir=w", "--ids=1", "--layer=0", "--out=a.png", f"--bpe_file={URL}"], "--bpe_file"),
    (["plots", "positions", f"--out={URL}"], "--out"),
    (["summary", f"--config={URL}"], "--config"),
    (["summary", f"--hf={URL}"], "--hf"),
    (["aot", f"--config={TINY}", "--topology=v5e:2x2", f"--json={URL}"], "--json"),
]


@pytest.mark.parametrize(("argv", "flag"), LOCATION_FLAGS, ids=[f"{a[0]} {f}" for a, f in LOCATION_FLAGS])
def test_a_location_no_client_reads_is_one_line_naming_the_flag(argv: list[str], flag: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Every command flag and config key that names a place goes through `storage.check` before any work: an
    ftp:// URL is refused in one line naming it, and no local directory named "ftp:" appears."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text to prepare " * 50)
    assert commands.dispatch(["jaxgpt", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}=") and URL in err and len(err.strip().splitlines()) == 1, err
    assert not any(p.name.startswith("ftp") for p in tmp_path.rglob("*"))


def test_a_bucket_url_for_a_local_file_says_to_copy_it(capsys: pytest.CaptureFixture) -> None:
    assert commands.dispatch(["jaxgpt", "bpe", "verify", "--dest=gs://bucket/gpt2.tiktoken"]) == 2
    assert "is a URL, but --dest takes a local path: copy the file" in capsys.readouterr().err
