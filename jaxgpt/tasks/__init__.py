"""Tasks: the training objectives the one training loop (`jaxgpt.train.loop`) trains.

Language modelling (`lm`), seed 001's classification fine-tuning (`classify`), the encoder-decoder on text pairs
(`seq2seq`), supervised fine-tuning on conversations (`chat`), reinforcement learning on checkable rewards
(`rl`, a subpackage) and preference tuning (`dpo`, a subpackage) are tasks; their data readers are in
`jaxgpt.data`. A new task implements the loop's contract (`jaxgpt.train.task.Task`) and is listed in
`jaxgpt.train.task.TASKS`.
"""

from __future__ import annotations

import importlib

from jaxgpt.train.config import TrainConfig
from jaxgpt.train.lora import adapt
from jaxgpt.train.task import TASKS, Task


def build(cfg: TrainConfig) -> Task:
    """The task `cfg.task` names (`TASKS`, which the config schema checks it against), with its data opened and
    checked (before anything is compiled); with config.lora, its adapters on its frozen init_from (`train.lora`)."""
    module, _, name = TASKS[cfg.task][2].rpartition(".")
    return adapt(getattr(importlib.import_module(module), name)(cfg), cfg)
