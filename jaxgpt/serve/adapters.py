"""`jaxgpt serve --adapter NAME=PATH`: the LoRA adapters a server decodes beside its base, read and checked.

PATH is a jaxgpt LoRA run's work directory (`jaxgpt.train.lora`: its checkpoint holds the adapters alone, its meta
the base they adapt by content hash) or a PEFT adapter directory (`peft:DIR`, or a directory holding
adapter_config.json: `jaxgpt.io.peft`). A run's adapters must adapt the very weights served: the base's hash,
taken as the run saw its base (its context cropped to the run's, its layers scanned as the run's), must be the
one the run recorded. A PEFT adapter names no hash: its tensors must fit the served model's modules and shapes.

Every refusal is one line naming the adapter, and comes before anything is served: bad NAME=PATH syntax, two
adapters with one name, a name that is the base's own (requests name the base by it), a missing path, a run
without adapters, an adapter of another base, a run with parameters trained in full beside its adapters
(config.lora.modules_to_save: the packed form that serves several adapters in one batch has no place for per-adapter
whole tensors; the run itself, or its merged export, serves them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import jax

from jaxgpt import storage
from jaxgpt.errors import UserError
from jaxgpt.generate.adapters import Adapter
from jaxgpt.io import weights
from jaxgpt.io.peft import CONFIG_FILE, read_adapter
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables, stack_layers, unstack_layers


@dataclasses.dataclass(frozen=True)
class Spec:
    """One --adapter: the name requests use and the path it was read from (what /v1/models shows as its root)."""

    name: str
    path: str


def parse(given: Sequence[str], base_name: str) -> list[Spec]:
    """The --adapter values as specs; a UserError for bad syntax, a name given twice, or the base's name."""
    specs: list[Spec] = []
    for text in given:
        name, equals, path = text.partition("=")
        name, path = name.strip(), path.strip()
        if not equals or not name or not path:
            raise UserError(f"--adapter {text!r} is not NAME=PATH: give a name for requests' `model` and the "
                            "adapter's directory, e.g. --adapter sql=runs/sql_lora")
        if name == base_name:
            raise UserError(f"--adapter {text!r}: {name!r} is the base model's name, which requests use for the base "
                            "alone: give the adapter another name")
        if any(s.name == name for s in specs):
            raise UserError(f"--adapter: two adapters are named {name!r}: give each a name of its own")
        specs.append(Spec(name, path))
    return specs


def load(spec: Spec, base: weights.Weights) -> Adapter:
    """The adapter `spec` names, checked against the served `base`, in the base's layout (scanned or not)."""
    if not isinstance(base.model, ModelConfig):
        raise UserError(f"--adapter {spec.name}: adapters are served on GPT models, not on an encoder-decoder")
    where = f"--adapter {spec.name}={spec.path}"
    directory = spec.path.removeprefix("peft:")
    place = storage.location(directory, "--adapter", given=spec.path)
    with storage.guard(place, "reading"):
        if not place.is_dir():
            raise UserError(f"{where}: no such directory: give a LoRA run's work directory or a PEFT adapter "
                            "directory")
        peft = spec.path.startswith("peft:") or (place / CONFIG_FILE).is_file()
    try:
        if peft:
            tree, scale = read_adapter(directory, base.model, abstract_variables(base.model)["params"])
            return Adapter(spec.name, tree, scale)
        return _from_run(spec.name, directory, base)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _from_run(name: str, directory: str, base: weights.Weights) -> Adapter:
    """A LoRA run's adapters, once the served base is the one its meta records (by content hash)."""
    run = weights.load(f"workdir:{directory}", merge_lora=False)
    settings, cfg, served = run.meta.get("lora"), run.model, base.model
    if settings is None:
        raise UserError("that run trained every weight, not LoRA adapters: serve it on its own (jaxgpt serve "
                        f"--workdir {directory})")
    if lora.SAVED in run.params:
        full = ", ".join(settings.get("modules_to_save", ())) or "some parameters"
        raise UserError(f"it trains {full} in full beside its adapters (config.lora.modules_to_save), which the "
                        "batch's packed adapters cannot hold per adapter: serve the run itself (jaxgpt serve "
                        f"--workdir {directory}) or its merged export (jaxgpt hf export --merge)")
    recorded = settings["base"]["sha256"]
    if cfg.vocab_size > served.vocab_size:
        raise UserError(f"its vocabulary grew to {cfg.vocab_size} tokens beyond the base's {served.vocab_size} "
                        f"(a chat run's special tokens): serve it merged (jaxgpt serve --workdir {directory})")
    if cfg.n_layer != served.n_layer or _as_trained(base, cfg) != recorded:
        raise UserError(f"it adapts {settings['base']['source']} (hash {recorded}), not the weights served here: "
                        "serve it with the base it was trained on")
    tree = jax.device_get(run.params)
    if cfg.scan_layers != served.scan_layers:
        tree = stack_layers(tree, cfg.n_layer) if served.scan_layers else unstack_layers(tree, cfg.n_layer)
    return Adapter(name, tree, lora.scale(settings["alpha"], settings["rank"], settings["rslora"]))


@functools.cache
def _as_trained(base: weights.Weights, cfg: ModelConfig) -> str:
    """The content hash of the served base as a LoRA run of `cfg` held it (`weights.as_run_params`, fine-tuning's
    rule). Once per distinct run config: hashing every weight takes a while on a large base."""
    params = weights.as_run_params(base, cfg)
    return lora.digest(jax.device_get(params))


def root(spec: Spec) -> str:
    """The adapter's path as /v1/models shows it (vLLM's `root`): absolute when local."""
    directory = spec.path.removeprefix("peft:")
    return directory if "://" in directory else str(Path(directory).expanduser().absolute())
