"""`jaxgpt hf export --format gguf`: a tiny Llama run (weights, byte-level BPE tokenizer, chat template) written as
GGUF and read back by `gguf:` (F32 exact, F16 and Q8_0 within their rounding) and by transformers' GGUF loader
(logits within 1e-4 for F32), with llama.cpp's q/k order in the file; and the one-line refusals. (The other
families: test_gguf_export_families.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import user_error_line

gguf = pytest.importorskip("gguf")

from helpers.models import assert_trees_equal, save_run  # noqa: E402
from test_gguf import source_tensors, write_gguf  # noqa: E402

from jaxgpt.commands import hf as hf_command  # noqa: E402
from jaxgpt.data.conversations import TEMPLATE_FILE  # noqa: E402
from jaxgpt.io import weights  # noqa: E402
from jaxgpt.io.gguf import GGUFFile, load_gguf, unpermute  # noqa: E402
from jaxgpt.io.gguf_export import permute  # noqa: E402
from jaxgpt.model.gpt import init_params  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Llama run whose weights, tokenizer and template come from a GGUF file written as llama.cpp would."""
    root = tmp_path_factory.mktemp("gguf_export")
    write_gguf(root / "source.gguf", source_tensors(), types={})
    loaded = weights.load(f"gguf:{root / 'source.gguf'}")
    workdir = save_run(root / "run", loaded.model, loaded.params, loaded.tokenizer_meta)
    (workdir / TEMPLATE_FILE).write_text(loaded.meta["chat"]["template"])
    return workdir, loaded


def export(run, tmp_path, gguf_type: str) -> str:
    out = tmp_path / f"model-{gguf_type}.gguf"
    hf_command.export_gguf(str(run[0]), str(out), "latest", False, gguf_type)
    return str(out)


def test_f32_round_trip_is_exact_with_tokenizer_and_template(run, tmp_path):
    _, loaded = run
    back = weights.load(f"gguf:{export(run, tmp_path, 'F32')}")
    assert back.model == loaded.model
    assert_trees_equal(back.params, loaded.params)
    assert back.tokenizer_meta == loaded.tokenizer_meta
    assert back.meta["chat"] == loaded.meta["chat"]
    text = "<|im_start|>user\nthe 12 ü<|im_end|>"
    assert list(back.tokenizer().encode_array(text)) == list(loaded.tokenizer().encode_array(text))


@pytest.mark.parametrize(("gguf_type", "step"), [("F16", 2.0 ** -11), ("Q8_0", 1 / 127)])
def test_f16_and_q8_0_within_their_rounding(run, tmp_path, gguf_type, step):
    _, loaded = run
    path = export(run, tmp_path, gguf_type)
    types = {t.type_name for t in GGUFFile(path).tensors.values()}
    assert types == {gguf_type, "F32"}  # matrices in the type, norms kept F32
    params, _ = load_gguf(GGUFFile(path))
    for a, b in zip(*(jax_leaves(p) for p in (params, loaded.params)), strict=True):
        scale = np.abs(b).max() if gguf_type == "Q8_0" else np.abs(b)  # Q8_0: half a step of a block's max / 127
        assert np.all(np.abs(a - b) <= step * scale + 1e-7)


def jax_leaves(params) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]


def test_file_holds_llama_cpp_q_k_order(run, tmp_path):
    """The query rows in the file are llama.cpp's interleaved order: un-permuting them gives transformers' rows."""
    path = export(run, tmp_path, "F32")
    file = GGUFFile(path)
    stored = file.dequantize("blk.0.attn_q.weight")
    assert file.get("general.architecture") == "llama" and "output.weight" in file.tensors
    original = source_tensors()["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(unpermute(stored, 4), original) and not np.array_equal(stored, original)
    assert np.array_equal(permute(original, 4), stored)


@pytest.mark.torch
def test_transformers_gguf_loader_agrees(run, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_hf_llama import hf_logits, jax_logits

    _, loaded = run
    path = export(run, tmp_path, "F32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.rsplit("/", 1)[1],
                                                              dtype=torch.float32).eval()
    idx = np.random.default_rng(0).integers(0, loaded.model.vocab_size, size=(1, 100))
    theirs = hf_logits(model, idx)
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(jax_logits(loaded.params, loaded.model, idx), theirs, rtol=0, atol=TOL)


def test_refusals_are_one_line(run, tmp_path):
    workdir, loaded = run
    assert "F32, F16, Q8_0" in user_error_line(hf_command.export_gguf, str(workdir), str(tmp_path / "m.gguf"),
                                              "latest", False, "Q4_0")
    assert ".gguf file" in user_error_line(hf_command.export_gguf, str(workdir), str(tmp_path / "m.bin"), "latest",
                                          False, "F32")
    mistral, cfg = tmp_path / "mistral", loaded.model.replace(sliding_window=8)  # (a window on every layer)
    save_run(mistral, cfg, init_params(cfg, jax.random.key(0)), loaded.tokenizer_meta)
    message = user_error_line(hf_command.export_gguf, str(mistral), str(tmp_path / "m.gguf"), "latest", False, "F32")
    assert "Mistral" in message and "sliding window" in message and "--format hf" in message

