"""PEFT files without torch (`jaxgpt.io.peft`): written and read back exactly, scanned layers too; GPT-2's fused
c_attn refused for q/k/v."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util
from helpers.models import modern, shrink

from jaxgpt.errors import UserError
from jaxgpt.model import lora
from jaxgpt.model.gpt import abstract_variables
from jaxgpt.model.presets import get_preset

pytest.importorskip("safetensors")
from jaxgpt.io import peft

SETTINGS = {"rank": 4, "alpha": 8.0, "rslora": False}


def adapters_for(cfg, targets=()):
    found = lora.sites(abstract_variables(cfg)["params"], targets, 4)
    rng = np.random.default_rng(0)
    return found, jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32),
                               nn.unbox(lora.init_adapters(found, jax.random.key(0))))


@pytest.mark.parametrize("scan", [False, True])
def test_written_adapters_read_back_exactly(tmp_path: Path, scan: bool) -> None:
    cfg = modern("gqa").replace(gated_mlp=True, activation="silu", norm="rmsnorm", use_bias=False,
                                position="none", rope_theta=10000.0, scan_layers=scan)
    found, adapters = adapters_for(cfg)
    peft.write_peft(adapters, cfg, SETTINGS, tmp_path, "base")
    back = peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0), found)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_gpt2_c_attn_is_one_block_diagonal_lora_of_the_same_update(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    cfg = shrink(get_preset("gpt2"))
    _, adapters = adapters_for(cfg, ("q", "v", "o"))
    peft.write_peft(adapters, cfg, {**SETTINGS, "dropout": 0.05}, tmp_path, "gpt2")
    config = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    assert config["lora_dropout"] == 0.05  # config.lora.dropout, as PEFT names it
    assert config["rank_pattern"] == {"c_attn": 12} and config["alpha_pattern"] == {"c_attn": 24.0}
    assert config["fan_in_fan_out"]  # Conv1D
    tensors = load_file(tmp_path / peft.TENSORS_FILE)
    a = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"]
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]
    assert a.shape == (12, 32) and b.shape == (96, 12)
    delta_IO = (b @ a).T * 2.0  # PEFT's update of the (in, out) Conv1D weight, scale alpha / r = 24 / 12
    zero = {"h_0": {"attn": {"qkv": {"kernel": np.zeros((32, 3, 4, 8), np.float32)}}}}
    qkv = {"h_0": {"attn": {"qkv": adapters["h_0"]["attn"]["qkv"]}}}
    expected = lora.merge(zero, qkv, 2.0)["h_0"]["attn"]["qkv"]["kernel"]
    np.testing.assert_allclose(delta_IO, np.asarray(expected).reshape(32, 96), atol=1e-5)
    with pytest.raises(UserError, match="rank_pattern") as e:  # such a file is not read back
        peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0, targets="q,v,o"),
                       lora.sites(abstract_variables(cfg)["params"], ("q", "v", "o"), 4))
    assert "\n" not in str(e.value)


def llama_like(**changes):
    return modern("gqa").replace(gated_mlp=True, activation="silu", norm="rmsnorm", use_bias=False, position="none",
                                 rope_theta=10000.0, **changes)


@pytest.mark.parametrize("tied", [False, True])
def test_the_token_table_adapter_is_peft_embedding_lora_and_reads_back(tmp_path: Path, tied: bool) -> None:
    from safetensors.numpy import load_file

    cfg = llama_like(tie_embeddings=tied)
    targets = ("q", "embed") if tied else ("q", "embed", "head")
    found, adapters = adapters_for(cfg, targets)
    peft.write_peft(adapters, cfg, {**SETTINGS, "targets": list(targets)}, tmp_path, "base")
    config = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    assert config["ensure_weight_tying"] == tied and "embed_tokens" in config["target_modules"]
    tensors = load_file(tmp_path / peft.TENSORS_FILE)
    a, b = (tensors[f"base_model.model.model.embed_tokens.lora_embedding_{m}"] for m in "AB")
    assert a.shape == (4, cfg.vocab_size) and b.shape == (cfg.n_embd, 4)  # PEFT's (r, V) and (C, r)
    np.testing.assert_allclose(a.T @ b.T, np.asarray(lora.delta(adapters["wte"]["embed"]["lora_a"],
                                                                   adapters["wte"]["embed"]["lora_b"], 1)), atol=1e-5)
    back = peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0, targets=",".join(targets)), found)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def rewrite(root: Path, config_change=None, tensor_change=None) -> None:
    from safetensors.numpy import load_file, save_file

    config, tensors = json.loads((root / peft.CONFIG_FILE).read_text()), load_file(root / peft.TENSORS_FILE)
    (config_change or (lambda c: None))(config)
    (tensor_change or (lambda t: None))(tensors)
    (root / peft.CONFIG_FILE).write_text(json.dumps(config))
    save_file(tensors, str(root / peft.TENSORS_FILE))


def test_what_peft_saves_beside_the_adapter_is_skipped_and_a_foreign_tied_head_refused(tmp_path: Path) -> None:
    """PEFT writes an adapted table's and head's base weights (base_layer.weight) and, for a tied head, the head's
    LoRA tied to the table's: read back they are skipped; a head LoRA that is not the tie, or a tied table's
    adapter without ensure_weight_tying, is one line."""
    prefix = "base_model.model."
    untied = llama_like(tie_embeddings=False)
    found, adapters = adapters_for(untied, ("embed", "head"))
    peft.write_peft(adapters, untied, {**SETTINGS, "targets": ["embed", "head"]}, tmp_path / "untied", "base")
    rewrite(tmp_path / "untied", tensor_change=lambda t: t.update({
        f"{prefix}lm_head.base_layer.weight": np.zeros((untied.vocab_size, untied.n_embd), np.float32),
        f"{prefix}model.embed_tokens.base_layer.weight": np.zeros((untied.vocab_size, untied.n_embd), np.float32)}))
    back = peft.read_peft(str(tmp_path / "untied"), untied, lora.LoRAConfig(rank=4, alpha=8.0, targets="embed,head"),
                          found)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)

    tied = llama_like(tie_embeddings=True)
    found, adapters = adapters_for(tied, ("embed",))
    settings = lora.LoRAConfig(rank=4, alpha=8.0, targets="embed")

    def tie(t: dict, scale: float = 1.0) -> None:
        t[f"{prefix}lm_head.lora_A.weight"] = np.ascontiguousarray(t[f"{prefix}model.embed_tokens.lora_embedding_B"].T
                                                                    * scale)
        t[f"{prefix}lm_head.lora_B.weight"] = np.ascontiguousarray(t[f"{prefix}model.embed_tokens.lora_embedding_A"].T)

    for name, config_change, tensor_change, message in [
            ("tie", None, tie, None),
            ("foreign", None, lambda t: tie(t, 2.0), "not the token table's tied one"),
            ("untied_save", lambda c: c.update(ensure_weight_tying=False), None, "ensure_weight_tying")]:
        peft.write_peft(adapters, tied, {**SETTINGS, "targets": ["embed"]}, tmp_path / name, "base")
        rewrite(tmp_path / name, config_change, tensor_change)
        if message is None:
            jax.tree.map(np.testing.assert_array_equal, peft.read_peft(str(tmp_path / name), tied, settings, found),
                         adapters)
            continue
        with pytest.raises(UserError, match=message) as e:
            peft.read_peft(str(tmp_path / name), tied, settings, found)
        assert "\n" not in str(e.value)



def saving(cfg, adapters: dict, paths: list[tuple[str, ...]]) -> dict:
    """`adapters` with random parameters at `paths` trained in full beside them (config.lora.modules_to_save)."""
    rng = np.random.default_rng(1)
    flat = traverse_util.flatten_dict(nn.unbox(abstract_variables(cfg)["params"]))
    return {**adapters, lora.SAVED: traverse_util.unflatten_dict(
        {p: rng.normal(size=flat[p].shape).astype(np.float32) for p in paths})}


@pytest.mark.parametrize("scan", [False, True])
def test_modules_to_save_are_written_as_whole_hf_modules(tmp_path: Path, scan: bool) -> None:
    from safetensors.numpy import load_file

    cfg = llama_like(scan_layers=scan, tie_embeddings=False)
    _, adapters = adapters_for(cfg, ("q", "v"))
    layer = ("h", "ln_1", "scale") if scan else ("h_1", "ln_1", "scale")
    trained = saving(cfg, adapters, [("wte", "embedding"), ("ln_f", "scale"), layer])
    peft.write_peft(trained, cfg, SETTINGS, tmp_path, "base")
    config = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    layers = [f"model.layers.{i}.input_layernorm" for i in range(cfg.n_layer)] if scan else [
        "model.layers.1.input_layernorm"]
    assert config["modules_to_save"] == sorted(["model.embed_tokens", "model.norm", *layers])
    tensors = load_file(tmp_path / peft.TENSORS_FILE)
    full = trained[lora.SAVED]
    np.testing.assert_array_equal(tensors["base_model.model.model.embed_tokens.weight"], full["wte"]["embedding"])
    np.testing.assert_array_equal(tensors["base_model.model.model.norm.weight"], full["ln_f"]["scale"])
    ln_1 = tensors["base_model.model.model.layers.1.input_layernorm.weight"]
    np.testing.assert_array_equal(ln_1, full["h"]["ln_1"]["scale"][1] if scan else full["h_1"]["ln_1"]["scale"])
    assert sum("lora_" in name for name in tensors) == 2 * 2 * cfg.n_layer  # the adapters, as without


@pytest.mark.parametrize(("paths", "message"), [
    ([("h_0", "mlp", "fc", "bias")], r"part of transformer.h.0.mlp.c_fc in full, not its .*weight"),
    ([("wte", "embedding")], "token table is trained in full and tied to the head"),
])
def test_modules_to_save_peft_cannot_hold_are_refused_naming_merge(tmp_path: Path, paths: list, message: str) -> None:
    cfg = shrink(get_preset("gpt2"))
    _, adapters = adapters_for(cfg, ("q",))
    with pytest.raises(UserError, match=message) as e:
        peft.write_peft(saving(cfg, adapters, paths), cfg, SETTINGS, tmp_path, "gpt2")
    assert "--merge" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / peft.CONFIG_FILE).exists()


def test_a_peft_adapter_with_modules_to_save_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = llama_like(tie_embeddings=False)
    found, adapters = adapters_for(cfg, ("q",))
    peft.write_peft(saving(cfg, adapters, [("ln_f", "scale")]), cfg, SETTINGS, tmp_path, "base")
    with pytest.raises(UserError, match=r"trains model.norm in full.*merge_and_unload") as e:
        peft.read_peft(str(tmp_path), cfg, lora.LoRAConfig(rank=4, alpha=8.0, targets="q"), found)
    assert "\n" not in str(e.value)
