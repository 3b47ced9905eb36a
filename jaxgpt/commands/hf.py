"""Hugging Face GPT-2 directories: check one, or export a jaxgpt run as one.

    jaxgpt hf inspect PATH       # what a HF directory maps to, checked tensor by tensor
    jaxgpt hf export --workdir DIR --out PATH [--which best] [--overwrite]

An export is `config.json` + `model.safetensors`, loadable by `GPT2LMHeadModel.from_pretrained(PATH)`;
a classifier's head, which GPT-2 has no place for, is left out.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags
from flax import traverse_util

from jaxgpt import weights
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.errors import UserError
from jaxgpt.hf import CONFIG_FILE, SAFETENSORS_FILE, load_hf_gpt2, save_hf_gpt2, tensor_specs
from jaxgpt.summary import count_params

SUBCOMMANDS = ("inspect", "export")
INSPECTED_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_dim", "d_ff", "activation",
                    "norm_eps", "tie_embeddings", "embd_dropout", "attn_dropout", "resid_dropout")


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    """Only the flags of the sub-command named first (`inspect` has none)."""
    if list(argv[1:2]) != ["export"]:
        return
    flags.DEFINE_string("workdir", None, "a jaxgpt training work directory", flag_values=flags_)
    flags.DEFINE_string("out", None, "the directory to write (config.json + model.safetensors)", flag_values=flags_)
    flags.mark_flags_as_required(["workdir", "out"], flag_values=flags_)
    flags.DEFINE_enum("which", "latest", ("latest", "best"), "checkpoint of --workdir", flag_values=flags_)
    flags.DEFINE_bool("overwrite", False, "replace the checkpoint in a non-empty --out", flag_values=flags_)


def inspect(path: str) -> str:
    """A report of how a HF directory maps onto jaxgpt, after reading and checking every tensor."""
    params, cfg = load_hf_gpt2(path)
    shapes = {path: tuple(value.shape) for path, value in traverse_util.flatten_dict(params).items()}
    lines = [f"{path}: GPT-2 checkpoint, all {len(tensor_specs(cfg))} tensors present with the expected shapes"]
    lines += [f"  {name:<15}{getattr(cfg, name)}" for name in INSPECTED_FIELDS]
    lines.append(f"  {'parameters':<15}{count_params(shapes):,}")
    return "\n".join(lines)


def export(workdir: str, out: str, which: str, overwrite: bool) -> str:
    loaded = weights.load(f"workdir:{workdir}", which=which)
    params = dict(loaded.params)
    dropped = [k for k in ("cls_head",) if params.pop(k, None) is not None]
    root = save_hf_gpt2(params, loaded.model, out, overwrite=overwrite)
    note = f" (left out {', '.join(dropped)}: GPT-2 has no such head)" if dropped else ""
    return f"wrote {root / CONFIG_FILE} and {root / SAFETENSORS_FILE} from {workdir} ({which}){note}"


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    if not args or args[0] not in SUBCOMMANDS:
        raise UserError("give a sub-command first: `jaxgpt hf inspect PATH` or `jaxgpt hf export --workdir DIR "
                        "--out PATH` (see --help)")
    if args[0] == "inspect":
        if len(args) != 2:
            raise UserError(f"`jaxgpt hf inspect` takes one Hugging Face directory, got {len(args) - 1} arguments")
        print(inspect(args[1]))
        return
    no_arguments(args[1:])
    print(export(flags_.workdir, flags_.out, flags_.which, flags_.overwrite))


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv)


if __name__ == "__main__":
    sys.exit(main())
