"""Parameter table of a model: shapes and counts per module.

    jaxgpt summary --preset gpt2
    jaxgpt summary --preset keras-transformer  # an encoder-decoder preset (jaxgpt.model.presets.SEQ2SEQ_PRESETS)
    jaxgpt summary --config configs/stdlib_char.py --vocab_size 100 [--depth 3]
    jaxgpt summary --hf path/to/gpt2        # only its config.json is read

--config takes a training config file (configs/*.py with get_config()) or a JSON file of model fields
(alone or under "model"). Only shapes are computed (jax.eval_shape), so even gpt2-xl's table prints in
seconds without memory.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import load_config_file, no_arguments, run_command
from jaxgpt.errors import UserError
from jaxgpt.io.hf import hf_config_to_model_config, read_hf_config
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig, model_config_from_dict
from jaxgpt.model.presets import PRESETS, SEQ2SEQ_PRESETS, get_preset
from jaxgpt.tools.summary import summary

# The flags that name a file or directory, and what each takes (`storage.check`): files read here, locally.
LOCATIONS = {"config": storage.LOCAL, "hf": storage.LOCAL}


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    flags.DEFINE_string("preset", None, f"one of {', '.join([*PRESETS, *SEQ2SEQ_PRESETS])}", flag_values=flags_)
    flags.DEFINE_string("config", None, "a training config file (configs/*.py with get_config()) or a JSON file "
                        "of model fields", flag_values=flags_)
    flags.DEFINE_string("hf", None, "a Hugging Face directory, any family `jaxgpt hf` reads (only its config.json "
                        "is read)",
                        flag_values=flags_)
    flags.mark_flags_as_mutual_exclusive(["preset", "config", "hf"], required=True, flag_values=flags_)
    flags.DEFINE_integer("vocab_size", None, "vocabulary size, for configs that take it from the dataset",
                         flag_values=flags_)
    flags.DEFINE_integer("depth", 2, "path components that name a module row", lower_bound=1, flag_values=flags_)


def model_settings_in(path: Path) -> dict[str, Any]:
    """The model fields of a config file: a whole training config's `model`, or just the model's fields.

    A plain file path rather than an ml_collections config flag, because a JSON file of fields is accepted too.
    """
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    if path.suffix == ".json":
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
    else:
        values = load_config_file(str(path), "configs/stdlib_char.py").to_dict()
    values = values.get("model", values)
    if not isinstance(values, dict):
        raise UserError(f"{path}: the model config is not a mapping of fields")
    return dict(values)


def model_config(flags_: flags.FlagValues) -> ModelConfig | Seq2SeqConfig:
    if flags_.preset in SEQ2SEQ_PRESETS:
        cfg = SEQ2SEQ_PRESETS[flags_.preset]
        return cfg if flags_.vocab_size is None else cfg.replace(vocab_size=flags_.vocab_size)
    if flags_.preset:
        cfg = get_preset(flags_.preset)
    elif flags_.hf:
        cfg = hf_config_to_model_config(read_hf_config(flags_.hf), where=flags_.hf)
    else:
        fields = model_settings_in(Path(flags_.config))
        if flags_.vocab_size is not None:
            fields["vocab_size"] = flags_.vocab_size
        elif fields.get("vocab_size") is None:
            raise UserError(f"{flags_.config} takes vocab_size from its dataset: pass --vocab_size N")
        return model_config_from_dict(fields)
    return cfg if flags_.vocab_size is None else cfg.replace(vocab_size=flags_.vocab_size)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    no_arguments(args)
    print(summary(model_config(flags_), depth=flags_.depth))


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
