"""Parameter tables in the spirit of Keras' `model.summary()`, computed from shapes alone (`jaxgpt summary`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flax import traverse_util

from jaxgpt.model.config import ModelConfig, Seq2SeqConfig
from jaxgpt.model.gpt import abstract_variables


def param_shapes(cfg: ModelConfig | Seq2SeqConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flat {path: shape} of a GPT's or an encoder-decoder's parameters, without allocating them."""
    from flax import linen as nn

    from jaxgpt.model import encdec as seq2seq

    variables = seq2seq.abstract_variables(cfg) if isinstance(cfg, Seq2SeqConfig) else abstract_variables(cfg)
    abstract = nn.unbox(variables["params"])
    return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(abstract).items()}


def count_params(shapes: Mapping[tuple[str, ...], tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def summary(cfg: ModelConfig | Seq2SeqConfig, depth: int = 2) -> str:
    """A table of modules (grouped to `depth` path components) with parameter shapes and counts."""
    shapes = param_shapes(cfg)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for path, shape in shapes.items():
        module = path[:-1][:depth] or path[:1]
        groups.setdefault("/".join(module), []).append(("/".join(path[len(module):]), shape))
    width = max(len("module"), *(len(g) for g in groups)) + 2
    lines = [f"{'module':<{width}}{'parameters (shape)':<48}{'count':>14}", "=" * (width + 62)]
    for name, leaves in groups.items():
        described = ", ".join(f"{leaf} {'x'.join(map(str, s))}" for leaf, s in leaves)
        if len(described) > 46:
            described = described[:43] + "..."
        lines.append(f"{name:<{width}}{described:<48}{sum(math.prod(s) for _, s in leaves):>14,}")
    lines += ["=" * (width + 62), f"{'Total params':<{width + 48}}{count_params(shapes):>14,}"]
    return "\n".join(lines)
