"""Will it fit, and how fast could it be? Compile the real sharded train step for a TPU slice or GPUs, on a CPU.

    jaxgpt aot --config configs/gpt2_xl.py --topology v5p:4x4x4 \\
        [--config.mesh.fsdp=-1 --config.mesh.data=1 --config.batch_size=256 --config.model.remat=full ...]
    jaxgpt aot --config configs/gpt2_124m.py --topology h100:1 --config.batch_size=64 --config.grad_accum=1

Needs XLA's TPU compiler (libtpu: pip install "jax[tpu]") or jax's CUDA plugin (pip install "jax[cuda13]"),
which run on CPU-only hosts. Prints memory per chip against HBM, the FLOP count (XLA's plus attention kernels')
against the analytic one, the collectives of the compiled step, a roofline bound on the step time over compute,
HBM and ICI or NVLink, and for GPUs the loops, launches and host transfers of the step (see jaxgpt/tools/aot.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import define_config, no_arguments, require_config, run_command

EXAMPLE = "configs/gpt2_xl.py"
LOCATIONS = {"json": storage.LOCAL}  # (`storage.check`: refused before minutes of compiling, not after)


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    from jaxgpt.tools.aot import TOPOLOGY_HELP

    define_config(flags_, argv, EXAMPLE)
    flags.DEFINE_string("topology", None, f"TPU slice or GPUs to compile for: {TOPOLOGY_HELP}", flag_values=flags_,
                        required=True)
    flags.DEFINE_string("json", "", "also write the report as JSON to this file", flag_values=flags_)
    flags.DEFINE_bool("extrapolate_scan", True, "for scanned layers, compile unscanned 1- and 2-layer variants to "
                      "count FLOPs and bytes of all layers (XLA counts a loop body once)", flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    from jaxgpt.tools import aot
    from jaxgpt.train.config import from_config_dict

    no_arguments(args)
    aot.parse_topology(flags_.topology)  # a bad topology is reported before the config is read
    c = require_config(flags_, EXAMPLE)
    c.workdir = c.workdir or "aot"  # nothing is written there: the typed config only needs one
    report = aot.analyze(from_config_dict(c), flags_.topology, extrapolate_scan=flags_.extrapolate_scan)
    print(aot.format_report(report), flush=True)
    if flags_.json:
        Path(flags_.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
