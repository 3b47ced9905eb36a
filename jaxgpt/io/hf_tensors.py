"""The tensors of Hugging Face checkpoints: how one maps onto jaxgpt's parameter tree, reading and writing them.

Every model family `jaxgpt.io.hf` converts (GPT-2, NanoChat) is a list of `TensorSpec`s: an HF tensor, the
jaxgpt parameter it fills and the reshape, transpose, slot or sign flip between the two. So import and export
are one pair of loops here, whatever the family, and each is exact (no arithmetic but negation).

Reading safetensors needs only numpy; the pickle-based `pytorch_model.bin` needs torch.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxgpt.errors import UserError, optional_import
from jaxgpt.model.config import ModelConfig

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX)


def config_int(hf: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    """config.json's positive integer `key` (absent or null: `default`), or one line naming it and `where`."""
    value = hf.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def config_number(key: str, value: Any, where: str) -> float:
    """A positive number of config.json (`value` of `key`) as a float, or one line naming it and `where`."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{where}: {key}={value!r} must be a positive number")
    return float(value)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor and where it lives in jaxgpt's (unscanned) parameter tree."""

    hf_name: str  # as *ForCausalLM.save_pretrained names it
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    our_shape: tuple[int, ...]  # of the tensor's part of the parameter (its slot, with `part`)
    transpose: bool = False  # torch's Linear stores (out, in), a Flax kernel (in, out)
    # the slot of a fused kernel or bias, on the axis before its two head axes: q, k, v of (C, 3, H, D) or (3, H, D),
    # k, v of (C, 2, K, D)
    part: int | None = None
    flip_half: bool = False  # negate the second half of the last axis (rotary's sign convention, `hf_nanochat`)

    def to_ours(self, array: np.ndarray) -> np.ndarray:
        array = array.T.reshape(self.our_shape) if self.transpose else array.reshape(self.our_shape)
        return _flip_half(array) if self.flip_half else array

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        array = _flip_half(array) if self.flip_half else array
        return array.reshape(self.hf_shape[::-1]).T if self.transpose else array.reshape(self.hf_shape)


class QKVPlace(NamedTuple):
    """Where one of q, k, v sits in a GPT block's attention parameters."""

    kernel: str  # the module under `attn`: "qkv", "q" or "kv"
    slot: int | None  # its slot of the fused kernel's slot axis, None for the whole of `q`
    heads: int  # its number of heads: H for q, K for k and v


def qkv_places(cfg: ModelConfig) -> dict[str, QKVPlace]:
    """q, k and v in a GPT block's self-attention (`model.attention.Attention`): slots 0-2 of the fused
    (C, 3, H, D) `qkv` when every query head has its own key/value head (K == H), else the (C, H, D) `q` and
    slots 0-1 of the (C, 2, K, D) `kv` (grouped-query attention)."""
    H, K = cfg.n_head, cfg.n_kv_head
    if K == H:
        return {"q": QKVPlace("qkv", 0, H), "k": QKVPlace("qkv", 1, H), "v": QKVPlace("qkv", 2, H)}
    return {"q": QKVPlace("q", None, H), "k": QKVPlace("kv", 0, K), "v": QKVPlace("kv", 1, K)}


def _flip_half(array: np.ndarray) -> np.ndarray:
    half = array.shape[-1] // 2
    return np.concatenate([array[..., :half], -array[..., half:]], axis=-1)


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------------
# Reading tensors


class TensorReader:
    """Names and lazily read arrays of a checkpoint's weight files (one tensor in memory at a time)."""

    def __init__(self, names: Mapping[str, str], read: Callable[[str, str], np.ndarray]) -> None:
        self.file_of = dict(names)  # tensor name -> file holding it
        self._read = read

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def get(self, name: str) -> np.ndarray:
        return self._read(self.file_of[name], name)


def _weight_map(root: Path, index_name: str, single_name: str) -> dict[str, str] | None:
    """tensor -> file for a sharded checkpoint's index, or None when the single file is used."""
    if (root / single_name).is_file():
        return None
    try:
        index = json.loads((root / index_name).read_text())
        weight_map = dict(index["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {root / index_name}: {e}") from None
    missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
    if missing:
        raise UserError(f"{root / index_name} lists shard {missing[0]}, which is not in {root}")
    return weight_map


# safetensors dtypes -> numpy's (bfloat16 is ml_dtypes', which jax uses)
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}


def _safetensors_reader(root: Path) -> TensorReader:
    """Tensors read with plain file reads, one at a time. (safetensors' own reader maps the file, and every
    mapped page it touches stays in the process's resident memory: a whole second copy of the model by the end.)
    `safe_open` still checks each header and lists the names."""
    safe_open = optional_import("safetensors", f"reading {root / SAFETENSORS_FILE}").safe_open

    weight_map = _weight_map(root, SAFETENSORS_INDEX, SAFETENSORS_FILE)
    files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS_FILE]
    headers: dict[str, tuple[int, dict]] = {}
    names: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(root / file), framework="numpy") as handle:
                names.update({name: file for name in handle.keys()})  # noqa: SIM118 (safe_open is no dict)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise UserError(f"cannot read {root / file}: {e}") from None
        with open(root / file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            headers[file] = (8 + length, json.loads(f.read(length)))

    def read(file: str, name: str) -> np.ndarray:
        data_start, header = headers[file]
        entry = header[name]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise UserError(f"{root / file}: tensor {name!r} has dtype {entry['dtype']}, which jaxgpt does not "
                            f"read (supported: {', '.join(SAFETENSORS_DTYPES)})")
        start, end = entry["data_offsets"]
        with open(root / file, "rb") as f:
            f.seek(data_start + start)
            raw = f.read(end - start)
        return np.frombuffer(raw, dtype).reshape(entry["shape"])

    return TensorReader(names, read)


def _torch_reader(root: Path) -> TensorReader:
    torch = optional_import("torch", f"reading {root}'s {TORCH_FILE}-style weights (they need torch to read)",
                            otherwise=f"convert the checkpoint to {SAFETENSORS_FILE}")
    weight_map = _weight_map(root, TORCH_INDEX, TORCH_FILE)
    files = sorted(set(weight_map.values())) if weight_map else [TORCH_FILE]
    state: dict[str, Any] = {}
    for file in files:
        try:
            state.update(torch.load(root / file, map_location="cpu", weights_only=True))
        except Exception as e:  # torch raises many types for corrupt or non-zip files
            raise UserError(f"cannot read {root / file}: {e}") from None
    return TensorReader({name: TORCH_FILE for name in state},
                        lambda _file, name: state[name].detach().to(torch.float32).numpy())


def open_hf_tensors(path: str | os.PathLike[str]) -> TensorReader:
    """The tensors of a checkpoint directory: safetensors when present (no torch needed), else torch's pickle."""
    root = Path(path)
    if (root / SAFETENSORS_FILE).is_file() or (root / SAFETENSORS_INDEX).is_file():
        return _safetensors_reader(root)
    if (root / TORCH_FILE).is_file() or (root / TORCH_INDEX).is_file():
        return _torch_reader(root)
    raise UserError(f"{root} is not a Hugging Face checkpoint: it has {CONFIG_FILE} but no weights "
                    f"({SAFETENSORS_FILE} or {TORCH_FILE})")


def hf_tensors_to_params(tensors: TensorReader, specs: list[TensorSpec], dtype: Any, where: str = "checkpoint",
                         base_prefix: str = "") -> dict:
    """jaxgpt's unscanned parameter tree (jax arrays of `dtype`) from a checkpoint's tensors.

    Each parameter moves to the device as soon as its tensors are read (a fused kernel once its last slot is),
    so loading holds one copy of the model plus the tensor in hand, never a second whole tree. A file of the base
    model alone (GPT2Model, NanoChatModel, the original OpenAI upload) names its tensors without `base_prefix`:
    then that prefix is dropped from every name. Slots of a fused kernel are stacked.
    """
    bare = bool(base_prefix) and specs[0].hf_name not in tensors
    dtype = np.dtype(jnp.dtype(dtype))
    params: dict = {}
    slots_of = collections.Counter(spec.path for spec in specs if spec.part is not None)
    parts: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    for spec in specs:
        name = spec.hf_name.removeprefix(base_prefix) if bare else spec.hf_name
        if name not in tensors:
            raise UserError(f"{where} is missing tensor {name!r} (expected shape {spec.hf_shape} from config.json)")
        array = tensors.get(name)
        if tuple(array.shape) != spec.hf_shape:
            raise UserError(f"{where}: tensor {name!r} has shape {tuple(array.shape)}, but config.json implies "
                            f"{spec.hf_shape}")
        ours = np.ascontiguousarray(spec.to_ours(array)).astype(dtype, copy=False)
        del array
        if spec.part is None:
            _set(params, spec.path, jnp.asarray(ours))
            continue
        slots = parts.setdefault(spec.path, {})
        slots[spec.part] = ours
        if len(slots) == slots_of[spec.path]:
            _set(params, spec.path, jnp.asarray(np.stack([slots[i] for i in sorted(slots)], axis=ours.ndim - 2)))
            del parts[spec.path]
    return params


# ---------------------------------------------------------------------------------------------------
# Writing


def params_to_hf_tensors(params: Mapping, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """HF-named float32 numpy tensors of an unscanned parameter tree."""
    out = {}
    for spec in specs:
        try:
            array = np.asarray(_get(params, spec.path), dtype=np.float32)
        except KeyError:
            raise UserError(f"params have no {'/'.join(spec.path)}: they do not belong to this config") from None
        if spec.part is not None:
            array = np.take(array, spec.part, axis=array.ndim - 3)
        if array.shape != spec.our_shape:
            raise UserError(f"param {'/'.join(spec.path)} has shape {array.shape}, the config implies "
                            f"{spec.our_shape}")
        out[spec.hf_name] = np.ascontiguousarray(spec.to_hf(array))
    return out


def write_checkpoint(root: Path, tensors: dict[str, np.ndarray], hf_config: dict[str, Any], overwrite: bool) -> None:
    """model.safetensors (under a temporary name, then moved) and config.json, last: a loader's sign of a complete
    checkpoint. A non-empty directory is only written into with `overwrite`, and then its old weight files are
    removed so that no stale shard shadows the new weights."""
    save_file = optional_import("safetensors.numpy", "exporting to Hugging Face").save_file
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} exists and is a file: choose a directory for the exported checkpoint")
    if root.is_dir() and any(root.iterdir()):
        if not overwrite:
            raise UserError(f"{root} exists and is not empty: choose a new directory or pass overwrite "
                            "(--overwrite) to replace its checkpoint")
        for name in WEIGHT_FILES:
            (root / name).unlink(missing_ok=True)
        for shard in [*root.glob("model-*-of-*.safetensors"), *root.glob("pytorch_model-*-of-*.bin")]:
            shard.unlink()
    root.mkdir(parents=True, exist_ok=True)
    tmp_weights = root / (SAFETENSORS_FILE + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})  # "pt": transformers expects this tag
    os.replace(tmp_weights, root / SAFETENSORS_FILE)
    (root / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
