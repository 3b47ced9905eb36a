"""LoRA adapters for the serving tests without training: random A and a random nonzero B (a trained adapter's B
is nonzero; a fresh one's is zero and would change nothing), as a tree or as a LoRA run directory."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.io import weights
from jaxgpt.io.checkpoint import Checkpointer
from jaxgpt.model import lora
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import abstract_variables


def random_adapters(cfg: ModelConfig, targets: str, rank: int, seed: int, std: float = 1.0) -> dict:
    """Adapters of `targets` ("": every linear layer of the blocks) at `rank` for a model of `cfg`, initialized as
    PEFT does and the factor that starts at zero drawn with `std` (B; the token table's A), host arrays laid out as
    `cfg`'s parameters: scanned or not."""
    found = lora.sites(abstract_variables(cfg)["params"], tuple(t for t in targets.split(",") if t), rank)
    tree = nn.unbox(lora.init_adapters(found, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    zero = lambda path: path[-1].key == ("lora_a" if path[-2].key == "embed" else "lora_b")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: rng.normal(0, std, x.shape).astype(np.float32) if zero(path) else np.asarray(x), tree)


def save_lora_run(workdir: Path, base: str, cfg: ModelConfig, adapters: dict, tokenizer_meta: dict, rank: int,
                  alpha: float, base_sha: str | None = None) -> Path:
    """A LoRA run directory as `jaxgpt.train.lora` leaves it: the adapters alone in its checkpoint and its base
    (`base`, a weights source) recorded in meta["lora"] by content hash (`base_sha`: another hash, for a run of
    another base)."""
    recorded = base_sha or lora.digest(jax.device_get(weights.load_for(base, cfg).params))
    targets = sorted({target for _, target, _ in lora.adapter_leaves(adapters)})
    meta = {"model": cfg.to_dict(), "tokenizer": tokenizer_meta, "val_loss": 1.0, "config": {"seed": 0},
            "lora": {"rank": rank, "alpha": alpha, "rslora": False, "targets": targets,
                     "base": {"source": base, "sha256": recorded}}}
    ckpt = Checkpointer(workdir)
    ckpt.save({"params": adapters, "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": 2}, meta)
    ckpt.wait()
    ckpt.close()
    return workdir
