"""DPO runs on the training loop: the reward accuracy rises and the run is a chat run, the reference computed once
and read back on resume, gradient accumulation, a live reference, SIGKILL and resume, pairs from a Hub dataset."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import logged_records
from helpers.chat import save_char_base

from jaxgpt.errors import UserError
from jaxgpt.train.config import base_config

TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_base(tmp_path_factory.mktemp("base"))


def toy_pairs(path: Path, n: int = 200) -> Path:
    """A preference a small model learns in a few steps, whatever the prompt: a reply of 'a's over one of 'b's
    (text and conversation forms alternating)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        prompt = f"Say {''.join(rng.choice(list('xyzw'), 5))}"
        k = int(rng.integers(1, 4))
        if i % 2:
            lines.append({"prompt": prompt, "chosen": "a" * k, "rejected": "b" * k})
        else:
            lines.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": "a" * k}],
                          "rejected": [{"role": "assistant", "content": "b" * k}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dpo_config(workdir: Path, base: Path, **overrides: object):
    """The toy pairs beside the work directory (or the built-in ones: dpo.data=builtin), 16 pairs a step."""
    c = base_config()
    c.task, c.workdir, c.init_from = "dpo", str(workdir), f"workdir:{base}"
    c.dpo.data, c.dpo.val_fraction = str(toy_pairs(workdir.parent / "pairs.jsonl")), 0.15
    c.dpo.examples, c.dpo.datasets = 240, "arithmetic,reverse"
    c.batch_size, c.max_steps, c.eval_interval, c.log_interval, c.ckpt_interval, c.eval_batches = 16, 30, 15, 1, 15, 4
    c.dpo.beta, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = 0.5, 3e-2, 1, 0.0
    c.compilation_cache_dir = ""
    c.update_from_flattened_dict(overrides)
    return c


def test_reward_accuracy_rises_from_ln_2_and_the_run_is_a_chat_run(tmp_path: Path, base_run: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from helpers import train_run

    from jaxgpt.commands import sample
    from jaxgpt.generate.chat import ChatModel
    from jaxgpt.io import weights

    workdir = tmp_path / "run"
    result = train_run(dpo_config(workdir, base_run))
    steps = [r for r in logged_records(workdir) if "train_loss" in r and "val_loss" not in r]
    first = steps[0]
    assert first["step"] == 1 and abs(first["train_loss"] - 0.6931472) < 1e-5, first  # policy = reference
    assert abs(first["train_rewards/margins"]) < 1e-5
    assert all(f"train_{m}" in first for m in TRL_METRICS)
    assert steps[-1]["train_loss"] < 0.6 and result["val_rewards/accuracies"] > 0.8, result
    assert result["val_loss"] < 0.69 and result["val_rewards/margins"] > 0
    assert result["val_rewards/accuracies_by_dataset"] == {"pairs": result["val_rewards/accuracies"]}  # a file: one
    assert (workdir / "reference_logps.npz").exists() and (workdir / "chat_template.jinja").exists()
    loaded = weights.load(f"workdir:{workdir}")  # sample.py --chat and jaxgpt serve read a run through these
    chat = ChatModel.from_run(loaded.params, loaded.model, loaded.tokenizer(), loaded.meta, None)
    [reply] = chat.replies([("q", [{"role": "user", "content": "Say xyzwx"}])], max_new_tokens=3, seed=0,
                           temperature=0.0, top_p=1.0, slots=1)
    pytest.importorskip("jinja2")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say xyzwx\n"))
    capsys.readouterr()
    code = sample.main(["jaxgpt sample", f"--workdir={workdir}", "--chat", "--temperature=0", "--max_new_tokens=3"])
    out, err = capsys.readouterr()
    assert code == 0 and out == reply + "\n", err


def _params_equal(a: dict, b: dict) -> None:
    for x, y in zip(jax.tree.leaves(a["state"]["params"]), jax.tree.leaves(b["state"]["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resumed_it_reads_the_reference_back_and_equals_the_uninterrupted_run(tmp_path: Path, base_run: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import train_run

    from jaxgpt.tasks.dpo.task import DPO

    overrides = {"max_steps": 8, "ckpt_interval": 4, "eval_interval": 8}
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = train_run(dpo_config(whole_dir, base_run, **overrides))
    shutil.copytree(whole_dir, split_dir)  # the run as a kill after step 4's checkpoint leaves it
    shutil.rmtree(split_dir / "checkpoints" / "8")

    def no_reference_pass(*_: object) -> None:
        raise AssertionError("a resumed run computed the reference log-probabilities again")

    monkeypatch.setattr(DPO, "_score_all", no_reference_pass)
    resumed = train_run(dpo_config(split_dir, base_run, **overrides))
    assert resumed["steps"] == 4 and resumed["val_loss"] == whole["val_loss"]
    _params_equal(whole, resumed)
    with pytest.raises(UserError, match=r"config.dpo settings \(beta\)"):
        train_run(dpo_config(split_dir, base_run, **{**overrides, "max_steps": 12, "dpo.beta": 0.2}))


def test_gradient_accumulation_equals_the_larger_batch(tmp_path: Path, base_run: Path) -> None:
    """8 pairs a step as one batch and as 8 micro-batches of 1: the losses within 1e-5, and the first step's
    gradient norm (both from the same weights) within 1e-6 (later, the weights drift apart by more than that: Adam
    divides tiny gradient entries by their own size, which magnifies float32's rounding)."""
    from helpers import logged_losses, train_run

    runs = {}
    for accum in (1, 8):
        workdir = tmp_path / f"accum{accum}"
        runs[accum] = train_run(dpo_config(workdir, base_run, batch_size=8, grad_accum=accum, max_steps=4,
                                           eval_interval=4, ckpt_interval=4))
        runs[accum]["losses"] = [v for _, v in logged_losses(workdir)]
    np.testing.assert_allclose(runs[1]["losses"], runs[8]["losses"], atol=1e-5, rtol=0)
    assert abs(runs[1]["val_loss"] - runs[8]["val_loss"]) < 1e-5
    norms = {accum: [r["grad_norm"] for r in logged_records(tmp_path / f"accum{accum}") if "grad_norm" in r]
             for accum in (1, 8)}
    np.testing.assert_allclose(norms[1][0], norms[8][0], rtol=1e-6)


def test_a_live_reference_equals_the_precomputed_one_and_reference_free_losses_compute_none(
        tmp_path: Path, base_run: Path) -> None:
    from helpers import logged_losses, train_run

    short = {"max_steps": 4, "eval_interval": 4, "ckpt_interval": 4}
    losses = {}
    for mode in ("precomputed", "live"):
        workdir = tmp_path / mode
        train_run(dpo_config(workdir, base_run, **short, **{"dpo.reference": mode}))
        losses[mode] = [v for _, v in logged_losses(workdir)]
        assert (workdir / "reference_logps.npz").exists() == (mode == "precomputed")
    np.testing.assert_allclose(losses["live"], losses["precomputed"], atol=1e-6, rtol=0)
    for loss_type in ("simpo", "orpo"):
        workdir = tmp_path / loss_type
        result = train_run(dpo_config(workdir, base_run, **short, **{"dpo.loss_type": loss_type}))
        assert not (workdir / "reference_logps.npz").exists() and np.isfinite(result["val_loss"])
    assert "val_nll_loss" in result and "val_log_odds_ratio" in result


@pytest.mark.slow
def test_sigkill_and_resume_equal_the_uninterrupted_run(tmp_path: Path, base_run: Path) -> None:
    """train.py with configs/chat_dpo.py (DPO's sigmoid loss) killed with SIGKILL after its checkpoint at step 4 or
    later, twice, then resumed to the end: the weights equal an uninterrupted run's bit for bit."""
    from helpers import ROOT
    from helpers.runs import killed_twice_equals_straight

    pairs = toy_pairs(tmp_path / "pairs.jsonl")
    flags = lambda workdir: [
        sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'chat_dpo.py'}",
        f"--config.workdir={workdir}", f"--config.init_from=workdir:{base_run}", f"--config.dpo.data={pairs}",
        "--config.dpo.val_fraction=0.15", "--config.batch_size=8", "--config.max_steps=16", "--config.ckpt_interval=3",
        "--config.eval_interval=16", "--config.log_interval=1", "--config.optim.lr=0.01", "--config.cpu_devices=0",
        "--config.dpo.loss_type=sigmoid",  # the reference computed once, and read back by each resume
        "--config.compilation_cache_dir="]
    killed_twice_equals_straight(flags, tmp_path, 16)


def test_sampled_rejections_are_the_models_own_kept_with_the_run_and_read_back(tmp_path: Path, base_run: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import train_run

    from jaxgpt.data.preferences import builtin_pairs
    from jaxgpt.tasks import build
    from jaxgpt.tasks.dpo import task as dpo_task
    from jaxgpt.train.config import from_config_dict

    workdir = tmp_path / "run"
    c = dpo_config(workdir, base_run, max_steps=2, eval_interval=2, ckpt_interval=2,
                   **{"dpo.data": "builtin", "dpo.rejected": "sampled", "dpo.examples": 60})
    result = train_run(c)
    assert set(result["val_rewards/accuracies_by_dataset"]) == set(result["val_exact_match_by_dataset"]) == {
        "arithmetic", "reverse"}
    kept = [json.loads(line) for line in (workdir / "rejected.jsonl").read_text().splitlines()]
    corrupted = [p.rejected for p in builtin_pairs(0, 60, ["arithmetic", "reverse"])]
    own = [r for r, k in zip(kept, corrupted, strict=True) if r != k]
    assert len(kept) == 60 and 0 < len(own) < 60  # the random model ends some replies, never with the answer

    def no_sampling(*_: object) -> None:
        raise AssertionError("the rejected replies were sampled again")

    monkeypatch.setattr(dpo_task, "sample_rejections", no_sampling)
    task = build(from_config_dict(c))
    assert sorted(p.rejected for p in task.pairs) == sorted(kept)


@pytest.mark.torch  # datasets: lm-evaluation-harness's, in CI's oldest lane
def test_a_hub_dataset_trains_as_the_same_pairs_in_a_jsonl_file(tmp_path: Path, base_run: Path) -> None:
    """`dpo.data=hf:NAME` read through `datasets`, offline: a local dataset directory (a parquet file, as
    `datasets.load_dataset` reads a Hub dataset's files) of the toy pairs as conversations gives the same pairs
    and the same losses as the JSONL file of them (text and conversations mixed); a bad row is named."""
    datasets = pytest.importorskip("datasets")
    from helpers import logged_losses, train_run

    from jaxgpt.data.preferences import hub_pairs, load_pairs

    jsonl = toy_pairs(tmp_path / "pairs.jsonl")
    turn = lambda role, text: [{"role": role, "content": text}]
    rows = [{k: turn("user" if k == "prompt" else "assistant", v) if isinstance(v, str) else v for k, v in r.items()}
            for r in map(json.loads, jsonl.read_text().splitlines())]
    (tmp_path / "hub_data").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "hub_data" / "train.parquet")
    spec = f"hf:{tmp_path / 'hub_data'}"
    from_hub, from_file = hub_pairs(spec), load_pairs(str(jsonl))
    assert [(p.prompt, p.chosen, p.rejected) for p in from_hub] == [(p.prompt, p.chosen, p.rejected)
                                                                    for p in from_file]
    assert from_hub[3].origin == f"{spec} row 3"
    losses = {}
    for name, data in (("hub", spec), ("file", str(jsonl))):
        train_run(dpo_config(tmp_path / f"run_{name}", base_run, max_steps=2, eval_interval=2, ckpt_interval=2,
                             **{"dpo.data": data}))
        losses[name] = [v for _, v in logged_losses(tmp_path / f"run_{name}")]
    assert len(losses["hub"]) == 2 and losses["hub"] == losses["file"]
    rows[1]["rejected"] = rows[1]["chosen"]
    (tmp_path / "bad_data").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "bad_data" / "train.parquet")
    with pytest.raises(UserError, match=rf"^hf:{tmp_path / 'bad_data'} row 1: chosen equals rejected"):
        hub_pairs(f"hf:{tmp_path / 'bad_data'}")


@pytest.mark.torch
def test_offline_a_hub_dataset_is_one_line_naming_the_local_file_route(tmp_path: Path, base_run: Path) -> None:
    pytest.importorskip("datasets")
    from helpers import offline_train_error

    line = offline_train_error(tmp_path, "--config=configs/chat_dpo.py", f"--config.workdir={tmp_path / 'w'}",
                               f"--config.init_from=workdir:{base_run}",
                               "--config.dpo.data=hf:trl-lib/ultrafeedback_binarized")
    assert "cannot be reached" in line and "load_dataset('trl-lib/ultrafeedback_binarized', split='train')" in line
    assert "select_columns(['prompt', 'chosen', 'rejected'])" in line
    assert line.endswith("--config.dpo.data=pairs.jsonl")


@pytest.mark.torch
def test_a_dpo_run_after_sft_is_served_and_exported_as_a_chat_run(tmp_path: Path, base_run: Path) -> None:
    """Base -> SFT (2 steps) -> DPO (2 steps), then the DPO run through `jaxgpt serve` (a greedy chat completion by
    the openai client equals the reply `sample.py --chat` writes) and `jaxgpt hf export` (transformers loads it, its
    chat template gives jaxgpt's ids, and its greedy continuation is the served reply)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    pytest.importorskip("jinja2")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from helpers import serving, train_run
    from helpers.chat import sft_config

    from jaxgpt.commands import hf as hf_command
    from jaxgpt.data.conversations import encode_conversation
    from jaxgpt.generate.chat import ChatModel
    from jaxgpt.io import weights

    sft, dpo, out = tmp_path / "sft", tmp_path / "dpo", tmp_path / "hf"
    train_run(sft_config(sft, base_run, max_steps=2, eval_interval=2, log_interval=2))
    result = train_run(dpo_config(dpo, base_run, init_from=f"workdir:{sft}", max_steps=2, eval_interval=2,
                                  ckpt_interval=2, **{"optim.lr": 3e-3}))
    assert result["steps"] == 2 and np.isfinite(result["val_loss"])
    messages = [{"role": "user", "content": "Say xyzwx"}]
    loaded = weights.load(f"workdir:{dpo}")
    chat = ChatModel.from_run(loaded.params, loaded.model, loaded.tokenizer(), loaded.meta, None)
    [reply] = chat.replies([("q", messages)], max_new_tokens=6, seed=0, temperature=0.0, top_p=1.0, slots=1)
    assert reply  # something to compare
    with serving(f"--workdir={dpo}", "--slots=1", log=tmp_path / "serve.txt", timeout=180) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        served = client.chat.completions.create(model="dpo", messages=messages, max_tokens=6, temperature=0)
    assert served.choices[0].message.content == reply

    assert hf_command.main(["jaxgpt hf", "export", "--workdir", str(dpo), "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ours = encode_conversation(loaded.tokenizer(), [*messages, {"role": "assistant", "content": "x"}]).ids
    assert list(prompt["input_ids"]) == ours[:-2].tolist()  # the prompt through <|assistant|>
    ids = model.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=6, do_sample=False)
    assert tokenizer.decode(ids[0, len(prompt["input_ids"]):], skip_special_tokens=True) == reply
