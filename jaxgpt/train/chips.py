"""Published per-chip numbers of the accelerators jaxgpt plans for and measures against: one table.

`jaxgpt.tools.aot` reads the TPU rows and the H100 and H200 rows to bound a step ahead of time; the training
loop divides its model FLOP/s by the same peak (`peak_flops_for`) so that a run's MFU and the plan's roofline
bound are measured against the same number. Peaks are dense bf16 (no sparsity); `ici_bandwidth` is the
bandwidth one ring collective along one mesh axis can use per chip: half the published bidirectional figure
(a ring uses two of a TPU chip's ports, each in both directions, while the published figure counts all of
them); for NVIDIA GPUs the NVLink figure, halved the same way (NVSwitch connects every GPU of a node at full
bandwidth, and a ring sends in one direction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxgpt.ops.platform import is_gpu

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator generation's per-chip numbers (vendors' published specifications)."""

    name: str
    device_kind: str  # what JAX calls it (a substring of `device.device_kind`)
    hbm_bytes: float
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s one ring collective can use per chip: ICI or NVLink (0: not known)


# Google Cloud's TPU pages: bf16 peak, HBM, and ICI as half the bidirectional per-chip figure (one ring).
TPUS: dict[str, Chip] = {
    "v4": Chip("v4", "TPU v4", 32 * GiB, 275e12, 1228e9, 300e9),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 200e9),
    "v5p": Chip("v5p", "TPU v5", 95 * GiB, 459e12, 2765e9, 600e9),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GiB, 918e12, 1640e9, 400e9),
}
# NVIDIA's data sheets (SXM parts unless named; dense bf16 tensor-core peak; NVLink 3, 4 and 5 per GPU, halved as
# for ICI); most specific name first.
GPUS: tuple[Chip, ...] = (
    Chip("H100 PCIe", "H100 PCIe", 80 * GiB, 756e12, 2000e9, 0.0),
    Chip("H100", "H100", 80 * GiB, 989e12, 3350e9, 450e9),
    Chip("H200", "H200", 141 * GiB, 989e12, 4800e9, 450e9),
    Chip("B200", "B200", 180 * GiB, 2250e12, 8000e9, 900e9),
    Chip("A100", "A100", 80 * GiB, 312e12, 2039e9, 300e9),
    Chip("L4", "L4", 24 * GiB, 121e12, 300e9, 0.0),
)


def chip_for(device: Any) -> Chip | None:
    """The table's row for a JAX device (by its device_kind), or None for CPUs and unknown chips.

    TPU kinds are matched exactly ("TPU v5" must not match "TPU v5 lite"); GPU kinds by name, most specific
    first ("NVIDIA H100 PCIe" before "H100").
    """
    kind = getattr(device, "device_kind", "")
    for chip in TPUS.values():
        if kind == chip.device_kind:
            return chip
    if is_gpu(getattr(device, "platform", "")):
        return next((chip for chip in GPUS if chip.device_kind in kind), None)
    return None


def peak_flops_for(devices: Sequence[Any]) -> float | None:
    """The summed published bf16 peak of `devices`, or None when one of them is not in the table (CPUs)."""
    chips = [chip_for(d) for d in devices]
    if not chips or any(c is None for c in chips):
        return None
    return sum(c.peak_flops for c in chips)
