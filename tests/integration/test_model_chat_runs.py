"""A model with its own tokenizer and chat template (a tiny random Llama directory made by transformers, its
vocabulary padded past the tokenizer's) through the commands: chat SFT from it saves and resumes and
`sample --chat` answers from the run with the model's template; `jaxgpt serve` answers a chat completion with
transformers' greedy answer and never samples a padded (phantom) id."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import serving
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
