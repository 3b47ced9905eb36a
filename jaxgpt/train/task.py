"""The training loop's contract: what a task (`jaxgpt.tasks`) gives `jaxgpt.train.loop`.

A task is the model, its data and its objective; the loop owns everything else (state, sharding, resume,
evaluation cadence, checkpoints, logs). The contract lives here, with the loop, so that the loop depends on it and
not on the tasks above it: `jaxgpt.tasks.build` makes the task a config names, and any object with these methods
trains unchanged. A task may also have `run_files` ({name: text}), files the loop writes into the work directory
when the run starts (the chat task's template); `use_weights(params)`, which the loop calls with the weights before
it reads a step's rows and before it evaluates: a task whose rows or metrics are sampled from the model being
trained (`rl`'s rollouts) takes them there, and its rows of step i are then a pure function of (seed, i) and those
weights; and `benchmarks(params, rows_sharding)`, metrics the loop adds to each evaluation (HellaSwag, which
`tasks.build` gives a language model when config.eval.hellaswag asks), its rows placed by `rows_sharding`.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.linen as nn
import jax
import numpy as np

from jaxgpt.model.config import ModelConfig, Seq2SeqConfig

# The objectives this loop trains (config.task): each one's line for `jaxgpt train --help`, the guide that covers it
# (tests/unit/test_docs.py holds the guides to this list) and what `jaxgpt.tasks.build` calls with the run's config. The
# makers are named, not imported: they sit in the tasks layer above this one.
TASKS = {
    "lm": ("language modelling on a token dataset (the default)", "docs/training.md", "jaxgpt.tasks.lm.from_config"),
    "classify": ("seed 001's classification fine-tuning", "docs/training.md", "jaxgpt.tasks.classify.Classification"),
    "seq2seq": ("the encoder-decoder on source/target pairs", "docs/seq2seq.md", "jaxgpt.tasks.seq2seq.Seq2Seq"),
    "chat": ("supervised fine-tuning on conversations", "docs/chat.md", "jaxgpt.tasks.chat.Chat"),
    "rl": ("reinforcement learning (GRPO) on rewards a program checks", "docs/rl.md", "jaxgpt.tasks.rl.task.RL"),
    "dpo": ("preference tuning (DPO, IPO, hinge, SimPO, ORPO) on chosen and rejected replies", "docs/dpo.md",
            "jaxgpt.tasks.dpo.task.DPO"),
}

Rows = dict[str, np.ndarray]  # a batch's rows held by one process: every leaf has the rows first


class Task(Protocol):
    model: nn.Module
    model_cfg: ModelConfig | Seq2SeqConfig
    tokenizer_meta: dict[str, Any]
    meta: dict[str, Any]  # saved with every checkpoint beside the model config and tokenizer
    batch_ndims: dict[str, int]  # every batch leaf and its number of axes (rows first)
    tokens_per_row: int  # for tokens/s and model FLOP/s
    eval_rows_per_batch: int

    def example_inputs(self) -> tuple[Any, ...]:
        """The smallest positional inputs `model.init` needs (tokens; the (source, target) pair for seq2seq):
        parameter shapes do not depend on them."""

    def loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict]:
        """(mean loss, {term: value}) of one micro-batch in training mode (dropout from `key`)."""

    def evaluate(self, params: Any, batch: dict[str, jax.Array]) -> Any:
        """Per-batch evaluation outputs (dropout off); `summarize` combines them."""

    def pretrained(self) -> Any | None:
        """Initial parameters from elsewhere (host arrays), or None for a random init. Top-level subtrees
        the model has but these lack (a new head) are initialized."""

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        """A UserError if the checkpoint in `workdir` belongs to a different run."""

    def train_rows(self, step: int, process_index: int, process_count: int) -> Rows:
        """Rows [p * n / P, (p + 1) * n / P) of the global training batch of `step`: a pure function of
        (seed, step), so resuming needs no iterator state."""

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[Rows]]:
        """Fixed evaluation batches per split (the same every call), split over processes like `train_rows`."""

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Metrics from every split's `evaluate` outputs; must hold `val_loss` (the best-checkpoint metric)."""

    def describe(self) -> str:
        """A line (or a few) printed when the run starts."""

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        """The console line of an evaluation."""

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        """An extra closing line after the throughput report, or None."""
