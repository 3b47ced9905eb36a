"""LoRA adapters in PEFT's format, out and in: what `peft.PeftModel.from_pretrained` loads onto transformers' base.

A PEFT adapter directory is `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with, per adapted module, `base_model.model.<HF module>.lora_A.weight` (r, in) and
`.lora_B.weight` (out, r): torch's Linear layout, whatever the base stores (GPT-2's Conv1D too). The HF module of
each of jaxgpt's adapters comes from the family's tensor specs (`jaxgpt.io.hf`), the one table of HF names: the
spec of a kernel (and its slot of a fused q/k/v kernel) names the module. GPT-2's c_attn holds q, k and v in one
module, which PEFT adapts as one: its adapters are written as one LoRA of rank 3r (A stacked, B block-diagonal), with
rank_pattern and alpha_pattern keeping its scale, the exact sum of the three updates.

The token table's adapter (target "embed") is PEFT's Embedding LoRA: `lora_embedding_A` (r, V) and
`lora_embedding_B` (C, r), no `.weight`, the same update (its lookup adds A[ids] s B). With tied embeddings the head
reads the adapted table in jaxgpt, as in PEFT with `ensure_weight_tying` (its head then gets a LoRA tied to the
table's), which the export sets; an adapter on a tied table without it is refused (PEFT's own head would read the
unadapted table, and its merge the adapted one). PEFT saves an adapted table's or head's base weight beside it
(`<module>.base_layer.weight`, save_embedding_layers): read back, it is the base's, not the adapter, and is skipped.

Parameters a run trains in full beside its adapters (config.lora.modules_to_save) are PEFT's modules_to_save: whole
HF modules, listed by full name in adapter_config.json and stored under their plain HF tensor names
(`base_model.model.model.norm.weight`), which PeftModel loads into its copies of those modules. A parameter that is
only part of an HF module (a Linear's bias without its weight), has no HF tensor, or is a tied token table (PEFT's
copy of the table would leave the tied head reading the original) is refused in one line naming --merge.

Written as vLLM accepts it: one rank and alpha for every module except that c_attn. Read back, a file with anything
else (DoRA, modules_to_save, per-module ranks, unknown keys, other shapes) is refused with one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxgpt.errors import UserError, optional_import
from jaxgpt.io.hf import export_family
from jaxgpt.io.hf_tensors import params_to_hf_tensors
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import stack_layers, unstack_layers

CONFIG_FILE, TENSORS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one of jaxgpt's adapters goes in the HF model: its module, and for a module that fuses several targets
    (GPT-2's c_attn: q, k, v) the target's slot of `n`."""

    module: str  # e.g. model.layers.0.self_attn.q_proj
    slot: int | None
    n: int
    conv1d: bool  # the HF weight is (in, out) (GPT-2's Conv1D), which PEFT calls fan_in_fan_out


def module_names(cfg: ModelConfig) -> dict[tuple[tuple[str, ...], str], Place]:
    """(kernel module path, target) -> its `Place` in the family's HF model (unscanned paths)."""
    names = {}
    for spec in export_family(cfg).tensor_specs(cfg):
        module = spec.path[:-1]
        key = (module[-2] if len(module) > 1 else "", module[-1])
        if key not in lora.MODULES or spec.path[-1] != lora.weight_name(module[-1]):
            continue
        hf = spec.hf_name.removesuffix(".weight")
        conv1d = not spec.transpose and module[-1] != "wte"  # a table is (V, C) in both
        for i, (target, slot) in enumerate(lora.MODULES[key]):
            if slot == spec.part:
                names[(module, target)] = Place(hf, None, 1, conv1d)
            elif spec.part is None:  # fused in HF as in jaxgpt
                names[(module, target)] = Place(hf, i, len(lora.MODULES[key]), conv1d)
    return names


def tensor_name(module: str, target: str, m: str) -> str:
    """PEFT's key of A or B (`m`) of an adapter on HF module `module`: an Embedding's lora_embedding_A (r, V) and
    lora_embedding_B (C, r), a Linear's lora_A.weight (r, in) and lora_B.weight (out, r)."""
    return f"{PREFIX}{module}.lora_embedding_{m}" if target == "embed" else f"{PREFIX}{module}.lora_{m}.weight"


def _unscanned(adapters: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    return unstack_layers(adapters, cfg.n_layer) if cfg.scan_layers else adapters


def write_peft(adapters: dict[str, Any], cfg: ModelConfig, settings: dict[str, Any], out: str | os.PathLike[str],
               base_name: str) -> Path:
    """Write a run's adapters (host arrays) and its config.lora `settings` (meta["lora"]) as a PEFT directory."""
    safetensors = optional_import("safetensors.numpy", "hf")
    names = module_names(cfg)
    tensors, saved_modules = _saved_modules(adapters.get(lora.SAVED, {}), cfg)
    fused, places = {}, []
    for module, target, ab in lora.adapter_leaves(_unscanned(adapters, cfg)):
        place = names[(module, target)]
        a, b = np.asarray(ab["lora_a"], np.float32), np.asarray(ab["lora_b"], np.float32)
        r = a.shape[-1]
        a_rI, b_Or = a.reshape(-1, r).T, b.reshape(r, -1).T
        places.append(place)
        if place.slot is None:
            tensors[tensor_name(place.module, target, "A")] = np.ascontiguousarray(a_rI)
            tensors[tensor_name(place.module, target, "B")] = np.ascontiguousarray(b_Or)
        else:
            fused.setdefault((place.module, place.n), {})[place.slot] = (a_rI, b_Or)
    patterns = {name: _fused_module(tensors, name, n, parts) for (name, n), parts in fused.items()}
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    modules = sorted({p.module.split(".")[-1] for p in places})  # model.layers.0.self_attn.q_proj: PEFT matches q_proj
    s = lora.scale(settings["alpha"], settings["rank"], settings["rslora"])
    # a fused module's rank is n r (`_fused_module`); its alpha keeps the scale of every other module
    ranks = {name.split(".")[-1]: r_n for name, r_n in patterns.items()}
    alphas = {k: s * (math.sqrt(v) if settings["rslora"] else v) for k, v in ranks.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
              "r": settings["rank"], "lora_alpha": settings["alpha"], "use_rslora": settings["rslora"],
              "target_modules": modules, "rank_pattern": ranks, "alpha_pattern": alphas,
              "lora_dropout": settings.get("dropout", 0.0), "bias": "none",
              "fan_in_fan_out": any(p.conv1d for p in places), "modules_to_save": saved_modules or None,
              "use_dora": False, "inference_mode": True,
              "ensure_weight_tying": cfg.tie_embeddings and "embed" in settings.get("targets", ())}
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    safetensors.save_file(tensors, str(root / TENSORS_FILE), metadata={"format": "pt"})
    return root


def check_carried(cfg: ModelConfig, base_cfg: ModelConfig, settings: dict[str, Any], workdir: str) -> None:
    """Refuse, naming --merge, a LoRA run (`cfg`, its config.lora `settings`) that changed its base (`base_cfg`) in
    a way a PEFT adapter, which is applied to the base as published, cannot carry."""
    base = settings["base"]["source"]
    if cfg.vocab_size > base_cfg.vocab_size:
        raise UserError(f"{workdir} grew {base}'s vocabulary (a chat run's special tokens), which a PEFT adapter "
                        "cannot carry: export the merged model with --merge")
    if "wpe/embedding" in settings.get("modules_to_save", ()) and cfg.block_size < base_cfg.block_size:
        raise UserError(f"{workdir} trains {base}'s position table in full, cropped to {cfg.block_size} of its "
                        f"{base_cfg.block_size} positions, which PEFT's copy of the table cannot hold: export the "
                        "merged model with --merge")


def _saved_modules(saved: dict[str, Any], cfg: ModelConfig) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's tensors and modules_to_save (full HF module names) of a run's parameters trained in full (`saved`,
    the trainable tree's `lora.SAVED` part); one that is no whole HF module is a UserError naming --merge."""
    if not saved:
        return {}, []
    saved = unstack_layers(saved, cfg.n_layer) if cfg.scan_layers and "h" in saved else saved
    paths = {tuple(k.key for k in kp) for kp, _ in jax.tree_util.tree_flatten_with_path(saved)[0]}
    specs = export_family(cfg).tensor_specs(cfg)
    by_module: dict[str, list] = {}
    for spec in specs:
        by_module.setdefault(spec.hf_name.rsplit(".", 1)[0], []).append(spec)
    wanted = {module for module, group in by_module.items() if any(spec.path in paths for spec in group)}
    fix = "PEFT's modules_to_save holds whole HF modules: export the merged model with --merge"
    if alone := sorted(paths - {spec.path for m in wanted for spec in by_module[m]}):
        raise UserError(f"{'/'.join(alone[0])} (trained in full) has no tensor in the Hugging Face model: {fix}")
    for module in sorted(wanted):
        if part := [spec for spec in by_module[module] if spec.path not in paths]:
            raise UserError(f"modules_to_save trains part of {module} in full, not its {part[0].hf_name}: {fix}")
        if cfg.tie_embeddings and ("wte", "embedding") in {spec.path for spec in by_module[module]}:
            raise UserError(f"the token table is trained in full and tied to the head, which PEFT's copy of "
                            f"{module} would leave reading the original: {fix}")
    chosen = [spec for module in sorted(wanted) for spec in by_module[module]]
    tensors = {f"{PREFIX}{name}": array for name, array in params_to_hf_tensors(saved, chosen).items()}
    return tensors, sorted(wanted)


def _fused_module(tensors: dict[str, np.ndarray], name: str, n: int, parts: dict[int, tuple]) -> int:
    """One LoRA of rank n r for an HF module that fuses n targets (GPT-2's c_attn): A stacks each slot's A (zero for
    a slot not adapted), B is block-diagonal, so B A is each slot's own update in its own rows. Returns n r."""
    a_rI, b_Or = next(iter(parts.values()))
    r, d_in, d_out = a_rI.shape[0], a_rI.shape[1], b_Or.shape[0]
    a_all, b_all = np.zeros((n * r, d_in), np.float32), np.zeros((n * d_out, n * r), np.float32)
    for slot, (a, b) in parts.items():
        a_all[slot * r:(slot + 1) * r] = a
        b_all[slot * d_out:(slot + 1) * d_out, slot * r:(slot + 1) * r] = b
    tensors[f"{PREFIX}{name}.lora_A.weight"], tensors[f"{PREFIX}{name}.lora_B.weight"] = a_all, b_all
    return n * r


def _read_config(directory: str) -> dict[str, Any]:
    root = Path(directory)
    if not (root / CONFIG_FILE).is_file() or not (root / TENSORS_FILE).is_file():
        raise UserError(f"peft:{directory} is not a PEFT adapter directory ({CONFIG_FILE} and {TENSORS_FILE})")
    return json.loads((root / CONFIG_FILE).read_text())


def read_peft(directory: str, cfg: ModelConfig, settings: lora.LoRAConfig, found: list[lora.Site]) -> dict[str, Any]:
    """A PEFT adapter directory as jaxgpt adapters for `found` (the run's sites): rank, alpha, rsLoRA and targets
    must be the run's config.lora, and every tensor must be one of them with its shape."""
    safetensors = optional_import("safetensors.numpy", "hf")
    root = Path(directory)
    c = _read_config(directory)
    where = f"peft:{directory}"
    if c.get("use_dora") or c.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where} is a {'DoRA' if c.get('use_dora') else c.get('peft_type')} adapter: only plain LoRA "
                        "loads (train it with use_dora=False)")
    if c.get("modules_to_save"):
        raise UserError(f"{where} trains {', '.join(c['modules_to_save'])} in full beside its adapters "
                        "(modules_to_save), which jaxgpt does not read back: merge it in peft (merge_and_unload, "
                        "save_pretrained) and load that as hf:DIR")
    if c.get("rank_pattern") or c.get("alpha_pattern"):
        raise UserError(f"{where} has per-module ranks (rank_pattern/alpha_pattern): only one rank and alpha for "
                        "every module load")
    tensors = safetensors.load_file(str(root / TENSORS_FILE))
    if cfg.tie_embeddings and not c.get("ensure_weight_tying") and any("lora_embedding_" in name for name in tensors):
        raise UserError(f"{where} adapts the token table of a model with tied embeddings without "
                        "ensure_weight_tying (PEFT's head then reads the unadapted table): save it with "
                        "LoraConfig(ensure_weight_tying=True)")
    theirs = (c["r"], float(c["lora_alpha"]), bool(c.get("use_rslora")))
    if theirs != (settings.rank, settings.alpha, settings.rslora):
        raise UserError(f"{where} has r={theirs[0]}, lora_alpha={theirs[1]:g}, use_rslora={theirs[2]}: pass "
                        f"--config.lora.rank={theirs[0]} --config.lora.alpha={theirs[1]:g} "
                        f"--config.lora.rslora={theirs[2]}")
    places = module_names(cfg)
    names = {tensor_name(place.module, target, m): (module, target, m)
             for (module, target), place in places.items() if place.slot is None for m in "AB"}
    tensors = _adapter_tensors(tensors, places, cfg, where)
    if unknown := sorted(set(tensors) - set(names)):
        raise UserError(f"{where} has {len(unknown)} tensors that are no LoRA weight of this {export_family(cfg).name} "
                        f"model, e.g. {unknown[0]}: it adapts another model")
    shapes = {(s.path, s.target): s for s in lora.sites_unscanned(found, cfg.n_layer)}
    adapters: dict[str, Any] = {}
    for name, array in tensors.items():
        module, target, m = names[name]
        site = shapes.get((module, target))
        if site is None:
            raise UserError(f"{where} adapts {target} ({name}), which config.lora.targets leaves out: pass "
                            f"--config.lora.targets with the adapter's targets")
        want = (settings.rank, math.prod(site.a_shape[:-1])) if m == "A" else (math.prod(site.b_shape[1:]),
                                                                                settings.rank)
        if array.shape != want:
            raise UserError(f"{where}: {name} is {array.shape}, this model's is {want}: the adapter is for another "
                            "base model")
        node = adapters
        for key in (*module, target):
            node = node.setdefault(key, {})
        node["lora_a" if m == "A" else "lora_b"] = (array.T.reshape(site.a_shape) if m == "A"
                                                    else array.T.reshape(site.b_shape)).astype(np.float32)
    if len(tensors) != 2 * len(shapes):
        raise UserError(f"{where} adapts {len(tensors) // 2} modules, config.lora.targets {len(shapes)}: pass "
                        "--config.lora.targets with the adapter's targets")
    return stack_layers(adapters, cfg.n_layer) if cfg.scan_layers else adapters


def _adapter_tensors(tensors: dict[str, np.ndarray], places: dict[tuple[tuple[str, ...], str], Place],
                     cfg: ModelConfig, where: str) -> dict[str, np.ndarray]:
    """`tensors` less what PEFT saves beside an adapter that is not one: the base weight of an adapted table or
    head (`base_layer.weight`; the base is init_from's) and, with tied embeddings, the head's LoRA tied to the
    table's (A = the table's B transposed, B = its A transposed: the table's own update, which jaxgpt's tied head
    reads already)."""
    adapted = {place.module for (_, target), place in places.items() if target in ("embed", "head")}
    skip = {f"{PREFIX}{module}.base_layer.weight" for module in adapted}
    table = next((place.module for (_, target), place in places.items() if target == "embed"), None)
    if cfg.tie_embeddings and table:
        skip.add(f"{PREFIX}lm_head.base_layer.weight")
    if cfg.tie_embeddings and table and f"{PREFIX}lm_head.lora_A.weight" in tensors:
        head = {m: tensors.get(f"{PREFIX}lm_head.lora_{m}.weight") for m in "AB"}
        emb = {m: tensors.get(tensor_name(table, "embed", m)) for m in "AB"}
        if any(x is None for x in (*head.values(), *emb.values())) or not (
                np.array_equal(head["A"], emb["B"].T) and np.array_equal(head["B"], emb["A"].T)):
            raise UserError(f"{where} has a LoRA on lm_head that is not the token table's tied one, but this "
                            "model ties its head to the table: it adapts another model")
        skip |= {f"{PREFIX}lm_head.lora_A.weight", f"{PREFIX}lm_head.lora_B.weight"}
    return {name: array for name, array in tensors.items() if name not in skip}


def base_source(directory: str) -> str:
    """The weights source of an adapter's base: `hf:` its base_model_name_or_path (a directory or a Hub id)."""
    config = _read_config(directory)
    if not config.get("base_model_name_or_path"):
        raise UserError(f"peft:{directory} names no base_model_name_or_path: train with its base as "
                        f"--config.init_from and --config.lora.init_from=peft:{directory}")
    return f"hf:{config['base_model_name_or_path']}"


def read_adapter(directory: str, cfg: ModelConfig, abstract_params: Any) -> tuple[dict[str, Any], float]:
    """(adapters, scale) of a PEFT directory on a model of `cfg` (its boxed abstract parameters), taking rank,
    alpha, rsLoRA and targets from the adapter itself."""
    config = _read_config(directory)
    targets = {target for (_, target), place in module_names(cfg).items() if place.slot is None
               and place.module.split(".")[-1] in config.get("target_modules", [])}
    settings = lora.LoRAConfig(rank=config["r"], alpha=float(config["lora_alpha"]),
                               rslora=bool(config.get("use_rslora")), targets=",".join(sorted(targets)))
    found = lora.sites(abstract_params, settings.target_names, settings.rank)
    return read_peft(directory, cfg, settings, found), lora.scale(settings.alpha, settings.rank, settings.rslora)
