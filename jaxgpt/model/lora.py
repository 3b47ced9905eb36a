"""LoRA's math: which kernels a target names, the adapters (A, B) beside them, and the merged weights.

A LoRA adapter of a projection with kernel W (in, out) is A (in, r), B (r, out); the adapted projection is
W + s B-after-A, s = alpha / r (alpha / sqrt(r) with rsLoRA). A starts as PEFT starts it (uniform within
1/sqrt(fan_in), its kaiming_uniform(a=sqrt(5))) and B at zero, so an adapted model begins exactly as its base.

Adapters mirror the model's parameter tree: the kernel of module `.../attn/qkv` gets `.../attn/qkv/{q,k,v}/{lora_a,
lora_b}`, one adapter per target, so the fused (C, 3, H, D) q/k/v kernel adapts each slot on its own (as PEFT's
separate q_proj, k_proj, v_proj do) and an adapter is self-describing: `merge` needs only the tree and the scale.
Multi-axis kernels keep their axes: A of `out` (H, D, C) is (H, D, r), B of `qkv`'s slot (r, H, D); scanned
layers put their L axis first on both. Every adapter axis has the kernel's logical name, and the rank "lora",
which the sharding rules replicate. The token table (target "embed", PEFT's Embedding LoRA) gets A (V, r) and
B (r, C) beside `wte/embedding`: its lookup adds A[ids] s B (`embed_adapter`), a tied head h (s B)^T A^T.

Whole parameters can train in full beside the adapters (config.lora.modules_to_save, PEFT's modules_to_save: e.g.
the token and position tables and the norms of a small base that must relearn them): the trainable tree then holds
them under its `SAVED` key at their own paths, so they get gradients, optimizer moments and checkpoint space as the
adapters do, and `merge` and `overlay` put them in place of the base's.

Two ways to run an adapted model. `merge` writes W + s A B into the kernels: what export and loading merged weights
read. `overlay` leaves the kernels alone and puts the adapters beside them in the parameter tree, where
`jaxgpt.model.layers.EinsumDense` finds them and adds (x A) (s B) to its slot of the projection (`project_adapters`):
no transient copy of any kernel, LoRA dropout on x before A, and (the stacked form) several adapters in one batch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError
from jaxgpt.model.config import comma_names

Array = jax.Array

# (parent module, kernel module) -> the targets it holds and each one's slot of a fused kernel (None: all of it)
MODULES: dict[tuple[str, str], tuple[tuple[str, int | None], ...]] = {
    ("attn", "qkv"): (("q", 0), ("k", 1), ("v", 2)),
    ("attn", "q"): (("q", None),),
    ("attn", "kv"): (("k", 0), ("v", 1)),
    ("attn", "out"): (("o", None),),
    ("mlp", "gate"): (("gate", None),),
    ("mlp", "fc"): (("up", None),),
    ("mlp", "proj"): (("down", None),),
    ("", "lm_head"): (("head", None),),
    ("", "wte"): (("embed", None),),
}
TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "head", "embed")
LINEAR = ("q", "k", "v", "o", "gate", "up", "down")  # the default: every linear layer of the blocks (gate if gated)
RANK_AXIS = "lora"
QUANTIZE = ("int8", "nf4")  # config.lora.quantize's formats (`jaxgpt.model.quant`)
SAVED = "modules_to_save"  # the trainable tree's key of the parameters trained in full (their paths below it)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """config.lora: LoRA fine-tuning (`jaxgpt.train.lora`), low-rank adapters beside the frozen init_from weights.

    It lives with the math it configures, as ModelConfig does; the run's config (`jaxgpt.train.config`) holds it.
    """

    rank: int = 0  # r of every adapter; 0: off (every weight trains)
    alpha: float = 16.0  # the update is (alpha / r) B A (alpha / sqrt(r) with rslora)
    rslora: bool = False  # rank-stabilized scaling alpha / sqrt(r)
    targets: str = ""  # comma-separated of q, k, v, o, gate, up, down, head, embed; "": every linear of the blocks
    init_from: str = ""  # peft:DIR: start the adapters from a PEFT adapter directory (its r, alpha, targets)
    dropout: float = 0.0  # PEFT's lora_dropout (its default 0 too): drops x before A, training only
    quantize: str = ""  # QLoRA: the frozen base's block kernels in "int8" (per channel) or "nf4" (`model.quant`)
    quantize_group: int = 64  # inputs per NF4 scale (bitsandbytes' 64)
    # comma-separated parameter patterns trained in full beside the adapters (PEFT's modules_to_save): names joined
    # by "/", each a glob, matching consecutive names of a parameter's path: "wte", "ln_*", "h_0/ln_1", "bias"
    modules_to_save: str = ""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise UserError(f"config.lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        if not self.rank and (self.targets or self.init_from or self.quantize or self.modules_to_save):
            raise UserError("config.lora.targets/init_from/quantize/modules_to_save are set but config.lora.rank=0 "
                            "(LoRA off): set --config.lora.rank (e.g. 16) or clear them")
        if self.quantize not in ("", *QUANTIZE):
            raise UserError(f"config.lora.quantize={self.quantize!r}: choose from {', '.join(QUANTIZE)} (or '' for a "
                            "float base)")
        if self.quantize_group <= 0 or self.quantize_group % 2:
            raise UserError(f"config.lora.quantize_group={self.quantize_group} must be a positive even number (64 "
                            "as bitsandbytes)")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"config.lora.dropout={self.dropout} must be in [0, 1) (PEFT's lora_dropout, e.g. 0.05)")
        if unknown := [t for t in self.target_names if t not in TARGETS]:
            raise UserError(f"config.lora.targets has {', '.join(unknown)}: choose from {', '.join(TARGETS)}")
        if self.init_from and not self.init_from.startswith("peft:"):
            raise UserError(f"config.lora.init_from={self.init_from!r}: use peft:DIR (a PEFT adapter directory)")

    @property
    def target_names(self) -> tuple[str, ...]:
        return comma_names(self.targets)

    @property
    def save_patterns(self) -> tuple[str, ...]:
        return comma_names(self.modules_to_save)


def input_axes(module: str) -> int:
    """Input axes of a kernel: the attention's output projection reads (H, D), every other one C (the token
    table's "input" is its vocabulary row)."""
    return 2 if module == "out" else 1


def weight_name(module: str) -> str:
    """The adapted parameter of a module: the token table's `embedding` (V, C), every projection's `kernel`."""
    return "embedding" if module == "wte" else "kernel"


def _slot(module_path: tuple[str, ...], target: str) -> int | None:
    parent = module_path[-2] if len(module_path) > 1 else ""
    return dict(MODULES[(parent, module_path[-1])])[target]


@dataclasses.dataclass(frozen=True)
class Site:
    """One adapter: the kernel module it adapts, its target name, and A's and B's shapes and logical names."""

    path: tuple[str, ...]  # the kernel's module, e.g. ("h_0", "attn", "qkv")
    target: str
    a_shape: tuple[int, ...]
    a_names: tuple[str | None, ...]
    b_shape: tuple[int, ...]
    b_names: tuple[str | None, ...]
    fan_in: int


def scale(alpha: float, rank: int, rslora: bool) -> float:
    """s of W + s B A: alpha / r, or rsLoRA's alpha / sqrt(r) (stable as the rank grows)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def sites(abstract_params: Any, targets: tuple[str, ...], rank: int) -> list[Site]:
    """The adapters of `targets` at rank r on a model's boxed abstract parameters (`nn.Partitioned` leaves); no
    targets: every linear layer of the blocks that the model has (`LINEAR`).

    A target named that matches no kernel, or a rank above a kernel's smaller side (then B A is no longer low-rank),
    is a UserError.
    """
    found: list[Site] = []
    wanted = targets or LINEAR
    flat = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    for key_path, leaf in flat:
        path = tuple(k.key for k in key_path)
        parent = path[-3] if len(path) > 2 else ""
        if (parent, path[-2]) not in MODULES or path[-1] != weight_name(path[-2]) or not isinstance(leaf,
                                                                                                   nn.Partitioned):
            continue
        module, shape, names = path[:-1], leaf.value.shape, leaf.names
        lead = 1 if names[0] == "layers" else 0
        n_in = input_axes(path[-2])
        for target, slot in MODULES[(parent, path[-2])]:
            if target not in wanted:
                continue
            skip = lead + n_in + (slot is not None)
            in_shape, out_shape = shape[lead:lead + n_in], shape[skip:]
            fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
            if rank > min(fan_in, fan_out):
                raise UserError(f"config.lora.rank={rank} is larger than {'/'.join(module)} ({target}: {fan_in} in, "
                                f"{fan_out} out): use a rank of at most {min(fan_in, fan_out)}")
            found.append(Site(module, target, (*shape[:lead], *in_shape, rank),
                              (*names[:lead], *names[lead:lead + n_in], RANK_AXIS),
                              (*shape[:lead], rank, *out_shape), (*names[:lead], RANK_AXIS, *names[skip:]), fan_in))
    missing = sorted(set(targets) - {s.target for s in found})
    if missing:
        raise UserError(f"config.lora.targets names {', '.join(missing)}, which this model does not have (an untied "
                        "head is needed for 'head'; q, k, v, o, gate, up, down are the blocks', embed the token "
                        "table's): drop them")
    return found


def sites_unscanned(found: list[Site], n_layer: int) -> list[Site]:
    """The sites of scanned layers (a leading "layers" axis) as one per layer `h_i`, as listed layers have them."""
    out = []
    for s in found:
        if s.a_names[0] != "layers":
            out.append(s)
            continue
        out += [dataclasses.replace(s, path=(f"h_{i}", *s.path[1:]), a_shape=s.a_shape[1:], a_names=s.a_names[1:],
                                    b_shape=s.b_shape[1:], b_names=s.b_names[1:]) for i in range(n_layer)]
    return out


def _matches(pattern: str, path: tuple[str, ...]) -> bool:
    """Whether `pattern` (names joined by "/", each a glob) names consecutive names of the parameter `path`."""
    names = pattern.split("/")
    return any(all(fnmatch.fnmatchcase(p, n) for p, n in zip(path[i:i + len(names)], names, strict=True))
               for i in range(len(path) - len(names) + 1))


def saved_params(abstract_params: Any, patterns: tuple[str, ...], found: list[Site]) -> dict[tuple[str, ...], Any]:
    """path -> boxed abstract leaf of every parameter config.lora.modules_to_save's `patterns` name (trained in full
    beside the adapters `found`). A pattern that matches nothing, or a weight an adapter adapts (it would train
    twice), is a UserError."""
    flat = {tuple(k.key for k in kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(
        abstract_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]}
    adapted: dict[tuple[str, ...], str] = {}
    for s in found:
        weight = (*s.path, weight_name(s.path[-1]))
        adapted[weight] = f"{adapted[weight]},{s.target}" if weight in adapted else s.target
    saved = {}
    for pattern in patterns:
        hits = [path for path in flat if _matches(pattern, path)]
        if not hits:
            raise UserError(f"config.lora.modules_to_save's {pattern!r} matches no parameter of this model (they are "
                            f"named like {', '.join('/'.join(p) for p in list(flat)[-3:])}): fix or drop it")
        if clash := [path for path in hits if path in adapted]:
            raise UserError(f"config.lora.modules_to_save's {pattern!r} matches {'/'.join(clash[0])}, which LoRA "
                            f"adapts ({adapted[clash[0]]}): narrow the pattern or drop {adapted[clash[0]]} from "
                            "config.lora.targets")
        saved.update({path: flat[path] for path in hits})
    return saved


def init_adapters(found: list[Site], key: jax.Array) -> dict[str, Any]:
    """Adapters boxed with logical names (`nn.LogicallyPartitioned`, as `nn.with_logical_partitioning` boxes):
    A uniform within 1/sqrt(fan_in) and B zero, PEFT's default; the token table's as PEFT's Embedding starts it
    (after LoRA's reference code), the other way round: A zero, B standard normal."""
    tree: dict[str, Any] = {}
    for i, site in enumerate(found):
        k = jax.random.fold_in(key, i)
        if site.target == "embed":
            a, b = jnp.zeros(site.a_shape, jnp.float32), jax.random.normal(k, site.b_shape, jnp.float32)
        else:
            bound = 1.0 / math.sqrt(site.fan_in)
            a = jax.random.uniform(k, site.a_shape, jnp.float32, -bound, bound)
            b = jnp.zeros(site.b_shape, jnp.float32)
        node = tree
        for name in (*site.path, site.target):
            node = node.setdefault(name, {})
        node["lora_a"] = nn.LogicallyPartitioned(a, site.a_names)
        node["lora_b"] = nn.LogicallyPartitioned(b, site.b_names)
    return tree


class Adapters:
    """The "model" a LoRA run initializes: its adapters and, under `SAVED`, the parameters it trains in full
    (`init` as a Flax module's, boxed). Those are zeros here, placeholders of their shapes and logical names: the
    run starts them from its base (`jaxgpt.train.lora.Adapted.pretrained`)."""

    def __init__(self, found: list[Site], saved: dict[tuple[str, ...], Any] | None = None) -> None:
        self.found, self.saved = found, saved or {}

    def init(self, key: jax.Array, *_: Any) -> dict[str, Any]:
        tree = init_adapters(self.found, key)
        for path, leaf in self.saved.items():
            tree = _set(tree, (SAVED, *path), leaf.replace_boxed(jnp.zeros(leaf.value.shape, leaf.value.dtype)))
        return {"params": tree}


def delta(a: jax.Array, b: jax.Array, n_in: int) -> jax.Array:
    """A (..., *in, r) @ B (..., r, *out) -> (..., *in, *out), in float32."""
    lead = a.shape[:a.ndim - n_in - 1]
    in_shape, out_shape = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
    a2 = a.astype(jnp.float32).reshape(*lead, math.prod(in_shape), a.shape[-1])
    b2 = b.astype(jnp.float32).reshape(*lead, b.shape[len(lead)], math.prod(out_shape))
    return jnp.matmul(a2, b2).reshape(*lead, *in_shape, *out_shape)


def adapter_leaves(adapters: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str,
                                                                                              dict[str, Any]]]:
    """(kernel module path, target, {"lora_a", "lora_b"}) of every adapter in a tree (not its `SAVED` params)."""
    if "lora_a" in adapters:
        return [(prefix[:-1], prefix[-1], dict(adapters))]
    return [leaf for name, sub in adapters.items() if prefix or name != SAVED
            for leaf in adapter_leaves(sub, (*prefix, name))]


def with_saved(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with each parameter the trainable tree holds under `SAVED` (trained in full) in place of its own."""
    out = dict(base)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(adapters.get(SAVED, {}))[0]:
        out = _set(out, tuple(k.key for k in key_path), leaf)
    return out


def saved_from(params: Mapping[str, Any], paths: Any) -> dict[str, Any]:
    """The trainable tree's `SAVED` part with `params`' values of the parameters at `paths`."""
    out: dict[str, Any] = {SAVED: {}}
    for path in paths:
        out = _set(out, (SAVED, *path), _get(params, path))
    return out


def merge(base: Mapping[str, Any], adapters: Mapping[str, Any], s: float) -> dict[str, Any]:
    """`base` with every adapted kernel replaced by W + s A B (its slot of a fused kernel), in W's dtype, and the
    parameters trained in full (`SAVED`) replacing the base's.

    Works on device arrays under jit (the training step) and on host arrays (loading, export) alike.
    """
    merged = with_saved(base, adapters)
    for module, target, ab in adapter_leaves(adapters):
        weight = (*module, weight_name(module[-1]))
        kernel = jnp.asarray(_get(merged, weight))
        a, b = jnp.asarray(ab["lora_a"]), jnp.asarray(ab["lora_b"])
        slot = _slot(module, target)
        index = (slice(None),) * (a.ndim - 1) + (() if slot is None else (slot,))  # the lead and input axes, the slot
        d = s * delta(a, b, input_axes(module[-1]))
        merged = _set(merged, weight, kernel.at[index].add(d.astype(kernel.dtype)))
    return merged


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for name in path:
        tree = tree[name]
    return tree


def _set(tree: Mapping[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of `tree` with `path` set (missing dicts along it made): only the dicts along the path are copied."""
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _set(tree.get(path[0], {}), path[1:], value)}


def digest(params: Any) -> str:
    """A content hash of parameters (every leaf's path, shape, dtype and bytes): which base an adapter belongs to."""
    h = hashlib.sha256()
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        array = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(key_path)}:{array.shape}:{array.dtype}".encode())
        h.update(array.tobytes())
    return h.hexdigest()[:16]


def overlay(params: Mapping[str, Any], adapters: Mapping[str, Any], s: float = 1.0, dropout: float = 0.0,
            key: Array | None = None) -> dict[str, Any]:
    """`params` with each adapter entry put beside the kernel it adapts (a deep merge: no kernel is copied), its B
    times the scale `s` so the projection needs no alpha or rank; `EinsumDense` then applies them unmerged.

    `dropout` > 0 (training only) gives each entry its LoRA dropout rate and a key of its own drawn from `key`, both
    with the adapter's leading (layers) axis, so scanned layers slice them like the kernels and every layer and
    target drops its own units; the token table's adapter has none (its input is ids, and PEFT's Embedding drops
    nothing either). The key travels in the tree rather than as the model's dropout rng because the tasks
    pass that rng only to models with dropout of their own. Stacked entries (several adapters packed along the rank
    axis, "rows" beside them) have their scales folded in by the stacker: s = 1. Parameters trained in full
    (`SAVED`) replace the base's.
    """
    out = with_saved(params, adapters)
    for i, (module, target, ab) in enumerate(adapter_leaves(adapters)):
        entry = {**ab, "lora_b": ab["lora_b"] if s == 1.0 else ab["lora_b"] * s}
        if dropout and target != "embed":
            a = ab["lora_a"]
            lead = a.shape[:a.ndim - input_axes(module[-1]) - 1]
            keys = jax.random.split(jax.random.fold_in(key, i), math.prod(lead))
            entry["dropout"] = jnp.full(lead, dropout, jnp.float32)
            entry["dropout_key"] = jax.random.key_data(keys).reshape(*lead, -1)
        out = _set(out, (*module, target), entry)
    return out


def embed_adapter(ids: Array, entry: Mapping[str, Any], dtype: str) -> Array:
    """The token table adapter's rows for `ids`: A[ids] (s B), (*ids, C) in float32 (B scaled by `overlay`): the
    lookup of the merged table E + s A B less E's own rows. The stacked form (adapters packed along the rank axis,
    "rows" (Bt, r) each row's mask over their columns, as `project_adapters` takes it) gives each row of ids (Bt, T)
    its own adapter's."""
    a, b = entry["lora_a"].astype(dtype), entry["lora_b"].astype(dtype)
    a_ids = jnp.take(a, ids, axis=0)
    if "rows" in entry:
        a_ids = a_ids * entry["rows"].astype(dtype)[:, None, :]
    return jnp.einsum("...r,rc->...c", a_ids, b, preferred_element_type=jnp.float32)


def attend_adapter(h: Array, entry: Mapping[str, Any], dtype: str) -> Array:
    """A tied head's logits from the token table adapter: h (s B)^T A^T, (..., V) in float32, so the head reads
    the merged table E + s A B as a merged model's does (and PEFT's with ensure_weight_tying); stacked, h (Bt, T, C)
    row by row through its own adapter's rank columns."""
    a, b = entry["lora_a"].astype(dtype), entry["lora_b"].astype(dtype)
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    hb = dot("...c,rc->...r", h.astype(dtype), b)
    if "rows" in entry:
        hb = hb * entry["rows"][:, None, :]
    return dot("...r,vr->...v", hb.astype(dtype), a)


def slot_of(module: str, target: str) -> int | None:
    """The slot of `target` in kernel module `module`'s output (qkv's q: 0), None for a whole kernel."""
    return next(dict(t)[target] for (_, m), t in MODULES.items() if m == module and target in dict(t))


def _rank_letter(spec: str) -> str:
    """An einsum letter for the rank axis that `spec` does not use."""
    return next(c for c in "rzyxwvu" if c not in spec)


def project_adapters(spec: str, module: str, x: Array, y: Array, entries: Mapping[str, Any], dtype: str) -> Array:
    """y (the projection `einsum(spec, x, W) + b`) plus each adapter entry's (x A) B in its slot: `EinsumDense`'s
    unmerged LoRA (the module docstring; the entries as `overlay` or a stacker leave them).

    Single form A (*in, r), B (r, *out). Stacked form (N adapters served in one batch): the same shapes with the
    adapters packed side by side along the rank axis (r = the sum of their ranks) and "rows" (Bt, r), each row's
    mask over those columns (1 on its own adapter's, all 0 for the base alone), which multiplies x A before B: one
    product as wide as the ranks together, nothing padded, every adapter's weights read once per call whatever the
    mix of rows. Products run in the compute `dtype` with float32 accumulation; an entry's "dropout" rate drops x
    before A, with its own "dropout_key" (`overlay`).
    """
    x_axes, k_axes = spec.split("->")[0].split(",")
    out_axes = spec.split("->")[1]
    n_in = sum(a in x_axes for a in k_axes)
    free = "".join(a for a in x_axes if a not in k_axes)
    r = _rank_letter(spec)
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    for target, entry in entries.items():
        slot = slot_of(module, target)
        rest = k_axes[n_in + (slot is not None):]
        y_axes = "".join(a for a in out_axes if a in free + rest)  # y's axes without the slot axis
        xt = x
        if "dropout" in entry:
            keep = 1.0 - entry["dropout"]
            kept = jax.random.bernoulli(jax.random.wrap_key_data(entry["dropout_key"]), keep, x.shape)
            xt = jnp.where(kept, x / keep.astype(x.dtype), 0)
        a, b = entry["lora_a"].astype(dtype), entry["lora_b"].astype(dtype)
        xa = dot(f"{x_axes},{k_axes[:n_in]}{r}->{free}{r}", xt.astype(dtype), a)
        if "rows" in entry:  # the stacked form: each row keeps its own adapter's rank columns
            xa = xa * entry["rows"].reshape(x.shape[0], *(1,) * (len(free) - 1), -1)
        d = dot(f"{free}{r},{r}{rest}->{y_axes}", xa.astype(dtype), b)
        if slot is None:
            y = y + d.astype(y.dtype)
        else:
            y = y.at[(slice(None),) * out_axes.index(k_axes[n_in]) + (slot,)].add(d.astype(y.dtype))
    return y
