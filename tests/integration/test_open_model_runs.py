"""A model with its own tokenizer and chat template (a tiny random Llama directory made by transformers, its
vocabulary padded past the tokenizer's) through the commands: chat SFT from it saves and resumes,
`sample --chat` answers from the run with the model's template and `jaxgpt hf export` of the run is a directory
transformers loads with the same logits, tokenizer and template; `jaxgpt serve` answers a chat completion with
transformers' greedy answer and never samples a padded (phantom) id; `jaxgpt data --tokenizer_from` prepares text
in its tokenizer for continued pretraining from it; `jaxgpt eval` of it gives transformers' loss."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import logged_records, serving
from helpers.runs import run
from helpers.tiny_llama import TEMPLATE, save_tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("httpx")
pytestmark = pytest.mark.torch
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama with its padded ids' head rows twice the row of the reply's first token: a sampler that
    forgot the tokenizer's size would answer with a phantom id."""
    root = tmp_path_factory.mktemp("tiny_llama")
    model, tokenizer = save_tiny_llama(root)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        first = int(model(ids).logits[0, -1, :len(tokenizer)].argmax())
        model.lm_head.weight[len(tokenizer):] = 2 * model.lm_head.weight[first]
    model.save_pretrained(root)
    return root, model, tokenizer


def test_chat_sft_from_the_model_saves_resumes_and_chats_in_its_template(llama, tmp_path):
    root, _, _ = llama
    data = tmp_path / "my.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + 3?"}, {"role": "assistant", "content": f"It is {i + 3}."}]})
                            + "\n" for i in range(8)))
    workdir = tmp_path / "run"
    train = lambda steps: run([sys.executable, "train.py", "--config", "configs/chat_sft.py",
                               f"--config.init_from=hf:{root}", f"--config.chat.data={data}",
                               f"--config.workdir={workdir}", "--config.batch_size=2",
                               "--config.cpu_devices=1", f"--config.max_steps={steps}", "--config.eval_interval=2",
                               "--config.eval_batches=1", "--config.chat.val_fraction=0.25"], check=True)
    first = train(2).stdout
    assert "no tokens added" in first and "starting from step 0" in first
    assert "resuming at step 2" in train(3).stdout
    assert (workdir / "chat_template.jinja").read_text() == TEMPLATE
    chat = run([sys.executable, "sample.py", "--workdir", str(workdir), "--chat", "--temperature", "0",
                "--max_new_tokens", "8"], input="What is 2 + 3?\n", check=True)
    assert chat.stdout.strip()
    _export_round_trips(workdir, tmp_path / "export", llama[2])


def _export_round_trips(workdir, out, original) -> None:
    """`jaxgpt hf export` of a run trained in the model's own template: transformers loads the directory, its
    tokenizer renders conversations as the original's does (template and special tokens written), and its logits
    are jaxgpt's of the run."""
    import numpy as np
    import transformers

    from jaxgpt.io import weights
    from jaxgpt.model.gpt import GPT

    run([sys.executable, "-m", "jaxgpt", "hf", "export", "--workdir", str(workdir), "--out", str(out)], check=True)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    conversation = [*QUESTION, {"role": "assistant", "content": "It is 5."}]
    render = lambda tok, **kw: tok.apply_chat_template(conversation, tokenize=True, return_dict=True, **kw)
    assert render(tokenizer)["input_ids"] == render(original)["input_ids"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == (original.bos_token, original.eos_token)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 0]
    ids = render(tokenizer)["input_ids"]
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(torch.as_tensor([ids])).logits.numpy()
    loaded = weights.load(f"workdir:{workdir}")
    ours = np.asarray(GPT(loaded.model).apply({"params": loaded.params}, np.asarray([ids], np.int32)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_serve_answers_with_transformers_greedy_reply_and_no_phantom_id(llama):
    import httpx

    root, model, tokenizer = llama
    vocab = len(tokenizer)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert int(model(ids).logits[0, -1].argmax()) >= vocab  # a phantom id outranks every real token
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[2, 0],
                             suppress_tokens=list(range(vocab, model.config.vocab_size)))[0, ids.shape[1]:].tolist()
    stopped = out[-1] in (2, 0)
    expected = tokenizer.decode(out[:-1] if stopped else out)
    with serving(f"--init_from=hf:{root}", timeout=240) as (_, url):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": QUESTION, "max_tokens": 16, "temperature": 0}).json()
        sampled = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "the quick", "max_tokens": 32, "temperature": 1.5, "seed": 3, "n": 4}).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == expected
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    assert all(c["finish_reason"] in ("stop", "length") for c in sampled["choices"]), sampled  # decodable: no phantom


TEXT = "the quick brown fox jumps over the lazy dog. Hello! How are you today? " * 12


def test_data_with_the_models_tokenizer_trains_the_lm_task_from_it(llama, tmp_path):
    root, _, tokenizer = llama
    (tmp_path / "my.txt").write_text(TEXT)
    data = tmp_path / "data"
    run([sys.executable, "-m", "jaxgpt", "data", "--text", str(tmp_path / "my.txt"), f"--tokenizer_from=hf:{root}",
         f"--out={data}", "--workers=1", "--val_fraction=0.2"], check=True)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["tokenizer"]["type"] == "tokenizer.json" and meta["vocab_size"] == len(tokenizer)
    assert meta["n_train"] + meta["n_val"] == len(tokenizer(TEXT)["input_ids"])  # its ids of the text
    proc = run([sys.executable, "train.py", "--config", "configs/mytext_gpt2.py", f"--config.init_from=hf:{root}",
                f"--config.data.dir={data}", f"--config.workdir={tmp_path / 'run'}", "--config.max_steps=2",
                "--config.batch_size=2", "--config.model.block_size=32", "--config.eval_interval=2",
                "--config.eval_batches=1", "--config.sample.max_new_tokens=4"], check=True)
    assert "starting from step 0" in proc.stdout and "val loss" in proc.stdout


def test_eval_of_the_directory_is_transformers_loss(llama, tmp_path, capsys):
    from jaxgpt.commands import eval as eval_command
    from jaxgpt.data.tokenizer_json import read_json_tokenizer
    from jaxgpt.evals.text import text_ids

    root, model, _ = llama
    (tmp_path / "short.txt").write_text(TEXT[:150])
    ids = text_ids([TEXT[:150]], read_json_tokenizer(root))
    assert len(ids) <= 65  # one window of 64 predictions
    assert eval_command.main(["eval", f"--init_from=hf:{root}", "--text", str(tmp_path / "short.txt"),
                              "--block_size=64"]) in (0, None)
    ours = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    with torch.no_grad():
        theirs = float(model(torch.as_tensor(ids[None]), labels=torch.as_tensor(ids[None])).loss)
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_dpo_from_the_model_renders_pairs_in_its_template_and_starts_at_ln_2(llama, tmp_path):
    """DPO straight from the model: each pair's prompt is transformers' rendering with the generation prompt and
    each reply runs through its end-of-turn token (not the template's newline after it); the first step's loss is
    ln 2 (policy = reference); the run keeps the model's template, and `sample --chat` answers in it."""
    import math

    from jaxgpt.data.model_chat import ModelChat
    from jaxgpt.data.preferences import Pair, encode_pair
    from jaxgpt.io import weights

    root, _, original = llama
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 3?"}],
                                         "chosen": [{"role": "assistant", "content": f"It is {i + 3}."}],
                                         "rejected": [{"role": "assistant", "content": f"It is {i + 4}."}]})
                             + "\n" for i in range(8)))
    workdir = tmp_path / "dpo"
    run([sys.executable, "train.py", "--config", "configs/chat_dpo.py", f"--config.init_from=hf:{root}",
         f"--config.dpo.data={pairs}", "--config.dpo.rpo_alpha=0", "--config.dpo.val_fraction=0.25",
         f"--config.workdir={workdir}", "--config.batch_size=2", "--config.cpu_devices=1", "--config.max_steps=2",
         "--config.log_interval=1", "--config.eval_interval=2", "--config.eval_batches=1"], check=True)
    steps = logged_records(workdir)
    first = next(m for m in steps if m["step"] == 1 and "train_loss" in m)
    assert first["train_loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(first["train_rewards/margins"]) < 1e-5
    assert (workdir / "chat_template.jinja").read_text() == TEMPLATE

    tokenizer = ModelChat(weights.load(f"hf:{root}").tokenizer(), weights.describe_chat(f"hf:{root}"))
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    encoded = encode_pair(tokenizer, Pair(prompt, "It is 5.", "It is 6.", "pairs", "test"), 200, 0, "keep_end")
    assert encoded.prompt == original.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    assert encoded.chosen == original.encode("It is 5.<|im_end|>", add_special_tokens=False)
    chat = run([sys.executable, "sample.py", "--workdir", str(workdir), "--chat", "--temperature", "0",
                "--max_new_tokens", "8"], input="What is 2 + 3?\n", check=True)
    assert chat.stdout.strip()
