"""LoRA runs and PEFT (`jaxgpt.io.peft`): a jaxgpt adapter loaded by `peft` onto transformers' base gives jaxgpt's
logits, a `peft` adapter loaded into jaxgpt gives peft's, the merged export equals adapter + base, and bad adapter
files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import load_tiny, train_run

from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model import lora
from jaxgpt.model.gpt import GPT
from jaxgpt.train.config import base_config, from_config_dict

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = np.array([[5, 17, 33, 2, 90, 64, 7, 11, 3, 40, 21, 9]])


def tiny_llama(root: Path, tied: bool) -> Path:
    """A tiny random Llama (grouped-query attention) as transformers saves it."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with an untied head."""
    return tiny_llama(tmp_path_factory.mktemp("llama") / "base", tied=False)


def lora_config(workdir: Path, data_dir: Path, base: Path, max_steps: int = 3,
                targets: str = "q,k,v,o,gate,up,down,head"):
    c = load_tiny(workdir=str(workdir), data_dir=str(data_dir), max_steps=max_steps, eval_interval=max_steps,
                  init_from=f"hf:{base}")
    c.model = base_config().model
    c.model.block_size = 32
    c.lora.rank, c.lora.alpha, c.lora.targets = 4, 8.0, targets
    return c


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def jax_logits(params, cfg) -> np.ndarray:
    return np.asarray(GPT(cfg.replace(dropout=0.0) if hasattr(cfg, "dropout") else cfg).apply({"params": params},
                                                                                              TOKENS))


def peft_gives_ours(base, adapter: Path, run: Path) -> np.ndarray:
    """`peft.PeftModel` of `adapter` on transformers' `base` gives the jaxgpt `run`'s logits, not the base's: its
    logits."""
    base_logits = hf_logits(base)
    theirs = hf_logits(peft.PeftModel.from_pretrained(base, adapter))
    loaded = weights.load(f"workdir:{run}")
    np.testing.assert_allclose(jax_logits(loaded.params, loaded.model), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - base_logits).max() > 1e-3  # the adapter changed the model
    return theirs


def test_export_loads_in_peft_and_merged_export_equals_it(tmp_path: Path, data_dir: Path, llama: Path) -> None:
    from jaxgpt.commands.hf import export

    train_run(lora_config(tmp_path / "run", data_dir, llama, targets="q,k,v,o,gate,up,down,head,embed"))
    print(export(str(tmp_path / "run"), str(tmp_path / "adapter"), "latest", False))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["modules_to_save"] is None
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj", "lm_head", "embed_tokens"])
    base = transformers.LlamaForCausalLM.from_pretrained(llama)
    base_logits = hf_logits(base)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    theirs = hf_logits(adapted)
    loaded = weights.load(f"workdir:{tmp_path / 'run'}")
    ours = jax_logits(loaded.params, loaded.model)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - base_logits).max() > 1e-3  # the adapter changed the model
    print(export(str(tmp_path / "run"), str(tmp_path / "merged"), "latest", False, merge=True))
    merged = hf_logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    np.testing.assert_allclose(merged, theirs, atol=1e-4, rtol=0)


def test_a_gpt2_export_with_q_k_v_loads_in_peft(tmp_path: Path, data_dir: Path) -> None:
    """GPT-2 fuses q, k, v into c_attn in Hugging Face: their adapters export as one block-diagonal LoRA of it."""
    from jaxgpt.commands.hf import export

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                                         n_head=4)).save_pretrained(tmp_path / "base")
    c = lora_config(tmp_path / "run", data_dir, tmp_path / "base", targets="")
    train_run(c)
    export(str(tmp_path / "run"), str(tmp_path / "adapter"), "latest", False)
    peft_gives_ours(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base"), tmp_path / "adapter",
                    tmp_path / "run")


def test_a_tied_table_exports_with_its_head_reading_the_adapted_table(tmp_path: Path, data_dir: Path) -> None:
    """With tied embeddings jaxgpt's head reads the adapted table: PEFT's with ensure_weight_tying, which the
    export sets."""
    from jaxgpt.commands.hf import export

    base_dir = tiny_llama(tmp_path / "base", tied=True)
    train_run(lora_config(tmp_path / "run", data_dir, base_dir, targets="q,v,embed"))
    export(str(tmp_path / "run"), str(tmp_path / "adapter"), "latest", False)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["ensure_weight_tying"]
    peft_gives_ours(transformers.LlamaForCausalLM.from_pretrained(base_dir), tmp_path / "adapter", tmp_path / "run")


def test_modules_to_save_export_as_peft_modules_to_save_with_jaxgpt_logits(tmp_path: Path, data_dir: Path,
                                                                         llama: Path) -> None:
    """Parameters trained in full beside the adapters (config.lora.modules_to_save) are PEFT's modules_to_save:
    PeftModel loads them into its copies of those modules and gives jaxgpt's logits; the merged export too."""
    from jaxgpt.commands.hf import export

    c = lora_config(tmp_path / "run", data_dir, llama, targets="q,v")
    c.lora.modules_to_save = "wte,ln_f,h_0/ln_1"
    train_run(c)
    export(str(tmp_path / "run"), str(tmp_path / "adapter"), "latest", False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.embed_tokens", "model.layers.0.input_layernorm", "model.norm"]
    theirs = peft_gives_ours(transformers.LlamaForCausalLM.from_pretrained(llama), tmp_path / "adapter",
                             tmp_path / "run")
    export(str(tmp_path / "run"), str(tmp_path / "merged"), "latest", False, merge=True)
    merged = hf_logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged"))
    np.testing.assert_allclose(merged, theirs, atol=1e-4, rtol=0)


def test_a_gpt2_run_saving_positions_and_layernorms_loads_in_peft(tmp_path: Path, data_dir: Path) -> None:
    """GPT-2's position table and LayerNorms (weight and bias) are whole HF modules, so PEFT holds them; not a
    position table the run cropped to its shorter context."""
    from jaxgpt.commands.hf import export

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                                         n_head=4)).save_pretrained(tmp_path / "base")
    for name, block_size in (("cropped", 32), ("run", 64)):
        c = lora_config(tmp_path / name, data_dir, tmp_path / "base", max_steps=2, targets="q,v")
        c.model.block_size, c.lora.modules_to_save = block_size, "wpe,ln_*"
        train_run(c)
    with pytest.raises(UserError, match=r"cropped to 32 of its 64 positions.*--merge") as e:
        export(str(tmp_path / "cropped"), str(tmp_path / "refused"), "latest", False)
    assert "\n" not in str(e.value)
    export(str(tmp_path / "run"), str(tmp_path / "adapter"), "latest", False)
    peft_gives_ours(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base"), tmp_path / "adapter",
                    tmp_path / "run")


LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(llama: Path, out: Path, modules: tuple[str, ...] = ()) -> None:
    """An adapter made by `peft` on transformers' base on the blocks' linear layers and `modules`, the factor that
    starts at zero randomized (a trained adapter's: B of a Linear, A of an Embedding). On lm_head or embed_tokens
    peft saves their base weights beside the adapter (save_embedding_layers), which jaxgpt skips."""
    base = transformers.LlamaForCausalLM.from_pretrained(llama)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[*LINEAR, *modules]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)


def test_a_peft_adapter_loads_into_jaxgpt_with_peft_logits(tmp_path: Path, data_dir: Path, llama: Path) -> None:
    from safetensors.numpy import load_file

    from jaxgpt.tasks import build

    peft_adapter(llama, tmp_path / "adapter", ("lm_head", "embed_tokens"))
    assert "base_model.model.lm_head.base_layer.weight" in load_file(tmp_path / "adapter" /
                                                                     "adapter_model.safetensors")
    base = transformers.LlamaForCausalLM.from_pretrained(llama)
    theirs = hf_logits(peft.PeftModel.from_pretrained(base, tmp_path / "adapter"))
    c = lora_config(tmp_path / "run", data_dir, llama, targets="q,k,v,o,gate,up,down,head,embed")
    c.lora.init_from = f"peft:{tmp_path / 'adapter'}"
    task = build(from_config_dict(c))
    params = lora.merge(task.base, task.pretrained(), task.scale)
    np.testing.assert_allclose(jax_logits(params, task.model_cfg), theirs, atol=1e-4, rtol=0)
    direct = weights.load(f"peft:{tmp_path / 'adapter'}")  # the weights source sample and serve take
    np.testing.assert_allclose(jax_logits(direct.params, direct.model), theirs, atol=1e-4, rtol=0)
    out = train_run(c)  # and trains further from it
    assert np.isfinite(out["val_loss"])


@pytest.mark.parametrize(("change", "message"), [
    (lambda c, t: c.update(use_dora=True), "DoRA"),
    (lambda c, t: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c, t: c.update(r=8), "r=8"),
    (lambda c, t: t.update({"base_model.model.model.extra.lora_A.weight": np.zeros((4, 32), np.float32)}), "no LoRA"),
    (lambda c, t: t.update({k: np.zeros((4, 7), np.float32) for k in list(t) if "q_proj.lora_A" in k}),
     "another base"),
])
def test_bad_peft_files_are_one_line_errors(tmp_path: Path, data_dir: Path, llama: Path, change, message) -> None:
    from safetensors.numpy import load_file, save_file

    from jaxgpt.tasks import build

    peft_adapter(llama, tmp_path / "adapter")
    config_file, tensors_file = tmp_path / "adapter" / "adapter_config.json", tmp_path / "adapter" / \
        "adapter_model.safetensors"
    config, tensors = json.loads(config_file.read_text()), load_file(tensors_file)
    change(config, tensors)
    config_file.write_text(json.dumps(config))
    save_file(tensors, tensors_file)
    c = lora_config(tmp_path / "run", data_dir, llama, targets="")
    c.lora.init_from = f"peft:{tmp_path / 'adapter'}"
    with pytest.raises(UserError, match=message) as e:
        build(from_config_dict(c))
    assert "\n" not in str(e.value)
    assert jax.devices()
