"""Tasks: the training objectives the one training loop (`jaxgpt.train.loop`) trains.

Language modelling (`lm`), seed 001's classification fine-tuning (`classify`), the encoder-decoder on text pairs
(`seq2seq`), supervised fine-tuning on conversations (`chat`) and reinforcement learning on checkable rewards
(`rl`, a subpackage) are tasks; their data readers are in `jaxgpt.data`. A new task implements the loop's contract
(`jaxgpt.train.task.Task`) and is added to `build`.
"""

from __future__ import annotations

from jaxgpt.data.tokenizer import tokenizer_from_meta
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.task import Task


def build(cfg: TrainConfig) -> Task:
    """The task `cfg.task` names, with its data opened and checked (before anything is compiled)."""
    if cfg.task == "classify":
        from jaxgpt.tasks.classify import Classification

        return Classification(cfg)
    if cfg.task == "seq2seq":
        from jaxgpt.tasks.seq2seq import Seq2Seq

        return Seq2Seq(cfg)
    if cfg.task == "chat":
        from jaxgpt.tasks.chat import Chat

        return Chat(cfg)
    if cfg.task == "rl":
        from jaxgpt.tasks.rl.task import RL

        return RL(cfg)
    from jaxgpt.tasks.lm import LanguageModelling, open_dataset

    task = LanguageModelling(cfg, open_dataset(cfg.data))
    if cfg.eval.hellaswag:  # scored at each evaluation (`Task.benchmarks`); the file is read here, before training
        from jaxgpt.evals.benchmarks import DuringTraining  # the evals package loads only for runs that use it

        tokenizer = tokenizer_from_meta(task.tokenizer_meta, cfg.data.bpe_file or None)
        task.benchmarks = DuringTraining(cfg.eval, task.model_cfg, tokenizer, task.eval_rows_per_batch)
    return task
