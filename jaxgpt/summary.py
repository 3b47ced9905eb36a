"""Parameter tables in the spirit of Keras' `model.summary()`, computed from shapes alone."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flax import traverse_util

from jaxgpt.config import ModelConfig
from jaxgpt.model import abstract_variables


def param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flat {path: shape} of a model's parameters, without allocating them."""
    from flax import linen as nn

    abstract = nn.unbox(abstract_variables(cfg)["params"])
    return {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(abstract).items()}


def count_params(shapes: Mapping[tuple[str, ...], tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def summary(cfg: ModelConfig, depth: int = 2) -> str:
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


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxgpt.summary --preset gpt2`: the table for a preset, a training config file or a HF directory.

    Only shapes are computed (jax.eval_shape), so even gpt2-xl's table prints in seconds without memory.
    """
    import argparse
    import importlib.util
    import json
    from pathlib import Path

    from jaxgpt.cli import exit_code
    from jaxgpt.config import model_config_from_dict
    from jaxgpt.errors import UserError
    from jaxgpt.presets import PRESETS, get_preset

    parser = argparse.ArgumentParser(prog="python -m jaxgpt.summary",
                                     description="Parameter table of a model: shapes and counts per module.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
    source.add_argument("--config", help="a training config file (configs/*.py with get_config()) or a JSON "
                                         "file of model fields")
    source.add_argument("--hf", help="a Hugging Face GPT-2 directory (only its config.json is read)")
    parser.add_argument("--vocab_size", type=int, help="vocabulary size, for configs that take it from the dataset")
    parser.add_argument("--depth", type=int, default=2, help="path components that name a module row (default 2)")
    args = parser.parse_args(argv)

    def from_config_file(path: Path) -> dict:
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        if path.suffix == ".json":
            try:
                values = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{path} is not valid JSON: {e}") from None
        else:
            spec = importlib.util.spec_from_file_location("_summary_config", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if not hasattr(module, "get_config"):
                raise UserError(f"{path} defines no get_config(): pass a configs/*.py training config")
            values = module.get_config().to_dict()
        values = values.get("model", values)  # a whole training config, or just the model's fields
        if not isinstance(values, dict):
            raise UserError(f"{path}: the model config is not a mapping of fields")
        return dict(values)

    def print_table() -> None:
        if args.preset:
            cfg = get_preset(args.preset)
        elif args.hf:
            from jaxgpt.hf import hf_config_to_model_config, read_hf_config

            cfg = hf_config_to_model_config(read_hf_config(args.hf), where=args.hf)
        else:
            fields = from_config_file(Path(args.config))
            if args.vocab_size is not None:
                fields["vocab_size"] = args.vocab_size
            elif fields.get("vocab_size") is None:
                raise UserError(f"{args.config} takes vocab_size from its dataset: pass --vocab_size N")
            cfg = model_config_from_dict(fields)
        if args.vocab_size is not None and args.config is None:
            cfg = cfg.replace(vocab_size=args.vocab_size)
        if args.depth < 1:
            raise UserError(f"--depth {args.depth} must be >= 1")
        print(summary(cfg, depth=args.depth))

    return exit_code(print_table)


if __name__ == "__main__":
    raise SystemExit(main())
