"""A chat run's export: its special tokens and chat template in the Hugging Face tokenizer (issue 38).

`AutoTokenizer.from_pretrained(export).apply_chat_template(...)` must give exactly the ids jaxgpt trains on and
serves (`encode_conversation`, and the run's template rendered as `jaxgpt serve` renders it), for a run really
fine-tuned with task chat (characters) and for runs built directly with GPT-2's BPE and with words.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from helpers.chat import ALPHABET, sft_config

from jaxgpt.commands import hf as hf_command
from jaxgpt.data.conversations import (
    CHAT_TEMPLATE,
    END,
    ROLE_TOKENS,
    TEMPLATE_FILE,
    ChatTemplate,
    builtin_conversations,
    chat_tokenizer,
    encode_conversation,
)
from jaxgpt.data.hf_tokenizer import read_tokenizer_meta
from jaxgpt.data.tokenizer import (
    CharTokenizer,
    Tokenizer,
    WithSpecialTokens,
    WordTokenizer,
    load_bpe,
    same_tokenizer,
)
from jaxgpt.generate import sampling
from jaxgpt.io import weights
from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import init_params
from jaxgpt.train.optim import OptimConfig, make_optimizer

pytestmark = pytest.mark.torch

CONVERSATIONS = [*builtin_conversations(7, 8), [
    {"role": "user", "content": "Spell 'hello' backwards."}, {"role": "assistant", "content": "olleh"},
    {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]]


def export(workdir: Path, out: Path) -> None:
    assert hf_command.main(["jaxgpt hf", "export", "--workdir", str(workdir), "--out", str(out)]) == 0


def hf_ids(hf_tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """apply_chat_template's ids: transformers 5 returns a BatchEncoding, 4 a list."""
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def check_chat_tokenizer(out: Path, tok: WithSpecialTokens) -> None:
    """Every conversation, whole and as a prompt for the last reply, gives jaxgpt's ids in transformers."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.chat_template == CHAT_TEMPLATE
    served = ChatTemplate(CHAT_TEMPLATE)  # as `jaxgpt serve` renders the run's template
    for conversation in CONVERSATIONS:
        encoded = encode_conversation(tok, conversation).ids.tolist()
        assert hf_ids(hf_tok, conversation, add_generation_prompt=False) == encoded
        prompt = hf_ids(hf_tok, conversation[:-1], add_generation_prompt=True)
        assert prompt == tok.encode(served.render(conversation[:-1], add_generation_prompt=True))
        assert prompt == encoded[:len(prompt)] and prompt[-1] == tok.special_ids[ROLE_TOKENS["assistant"]]
    ends = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert tok.special_ids[END] == (ends[0] if isinstance(ends, list) else ends)
    meta = read_tokenizer_meta(out)  # read back, so that an `hf:` source of the export has the chat tokens
    assert same_tokenizer(meta, tok.to_meta()) and meta["vocab_size"] == tok.vocab_size


# ---------------------------------------------------------------------------------------------------
# A run fine-tuned with task chat


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of chat fine-tuning from a random character-level model."""
    from helpers import train_run
    from helpers.models import save_random_lm

    base, workdir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("chat") / "run"
    save_random_lm(base, ModelConfig(vocab_size=len(ALPHABET), block_size=64, n_layer=2, n_head=2, n_embd=32),
                   CharTokenizer(ALPHABET))
    train_run(sft_config(workdir, base, max_steps=2, eval_interval=2, log_interval=2, **{"chat.examples": 40}))
    return workdir


def test_chat_run_exports_its_template_and_special_tokens(chat_run, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export(chat_run, tmp_path)
    loaded = weights.load(f"workdir:{chat_run}")
    tok = loaded.tokenizer()
    check_chat_tokenizer(tmp_path, tok)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    text = ChatTemplate(CHAT_TEMPLATE).render(CONVERSATIONS[-1])
    assert hf_tok.decode(tok.encode(text)) == text  # special tokens decode to their text, as jaxgpt's
    # The exported model answers a chat prompt as jaxgpt does (greedy).
    prompt = np.array([hf_ids(hf_tok, CONVERSATIONS[0][:-1], add_generation_prompt=True)])
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    theirs = model.generate(torch.as_tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    ours = sampling.generate(loaded.params, loaded.model, prompt, max_new_tokens=8, temperature=0.0)
    np.testing.assert_array_equal(theirs[:, prompt.shape[1]:], ours)


# ---------------------------------------------------------------------------------------------------
# Runs built directly: GPT-2's BPE and words under the chat tokens


def save_chat_run(workdir: Path, tok: WithSpecialTokens) -> None:
    """A chat run's directory as task chat leaves it (meta, template file), with random weights."""
    cfg = ModelConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=1, n_head=2, n_embd=16)
    params = init_params(cfg, jax.random.key(0))
    state = {"params": params, "opt_state": make_optimizer(OptimConfig()).init(params), "step": jnp.asarray(1)}
    ckpt = Checkpointer(workdir)
    ckpt.save(state, {"model": cfg.to_dict(), "tokenizer": tok.to_meta(),
                      "chat": {"template": CHAT_TEMPLATE, "end_token": END, "end_id": tok.special_ids[END]}})
    ckpt.wait()
    ckpt.close()
    (workdir / TEMPLATE_FILE).write_text(CHAT_TEMPLATE)


BASES: dict[str, Callable[[], Tokenizer]] = {
    "bpe": load_bpe,
    "word": lambda: WordTokenizer(["what", "is", "spell", "backwards", "hello", "'", "?", ".", "how", "many"]),
}


@pytest.mark.parametrize("kind", list(BASES))
def test_bpe_and_word_chat_runs_export_their_template(tmp_path, kind):
    tok = chat_tokenizer(BASES[kind]())
    save_chat_run(tmp_path / "run", tok)
    export(tmp_path / "run", tmp_path / "out")
    check_chat_tokenizer(tmp_path / "out", tok)
