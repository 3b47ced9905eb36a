"""Log-likelihoods of continuations given contexts, batched over requests of different lengths.

Every benchmark here (lm-evaluation-harness's loglikelihood and rolling perplexity, HellaSwag, LAMBADA) reduces
to one question: given token ids `context + continuation`, what is the summed log-probability of the
continuation, and is it the greedy one? Requests are sorted by length and cut into batches right-padded to a
power-of-two bucket (capped at the model's context), so a whole benchmark compiles one program per bucket
instead of one per request shape; right padding never changes the logits of the real positions (causal
attention), so each request's numbers equal those of the request alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxgpt.data.batches import bucket
from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT
from jaxgpt.ops.loss import target_logit
from jaxgpt.train.sharding import global_array, local_rows


@dataclasses.dataclass(frozen=True)
class Score:
    """A continuation's summed log-probability (nats), whether greedy decoding gives it, and its token count."""

    logprob: float
    greedy: bool
    tokens: int


def _token_logprobs(params: Any, inputs_BT: jax.Array, targets_BT: jax.Array, *, cfg: ModelConfig
                    ) -> tuple[jax.Array, jax.Array]:
    """Per position: log p(target | inputs so far) and whether the target is the argmax."""
    logits_BTV = GPT(cfg).apply({"params": params}, inputs_BT).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    return target_logit(logp_BTV, targets_BT), jnp.argmax(logits_BTV, axis=-1) == targets_BT


@functools.cache
def _compiled(cfg: ModelConfig, out_sharding: NamedSharding | None) -> Any:
    """One jitted scorer per model and placement, so a new Scorer (each evaluation of a run) compiles nothing."""
    return jax.jit(functools.partial(_token_logprobs, cfg=cfg), out_shardings=out_sharding)


def window(context: Sequence[int], continuation: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """The model's inputs for scoring `continuation` after `context` (the last block_size + 1 tokens, the final
    one only a target), and how many of the trailing targets are the continuation's."""
    if not continuation:
        raise UserError("a continuation to score has no tokens: every choice must have some text")
    if not context:
        raise UserError("a request has no context tokens: start it with the end-of-text token")
    if len(continuation) > block_size:
        raise UserError(f"a continuation of {len(continuation)} tokens does not fit the model's context of "
                        f"{block_size}: shorten it")
    tokens = [*context, *continuation][-(block_size + 1):]
    return tokens, len(continuation)


class Scorer:
    """Scores (context, continuation) token-id pairs with one model; see the module docstring.

    With `rows_sharding` (a training run's evaluation batch sharding), each batch is assembled from the rows this
    process's devices hold, the model runs on the run's sharded parameters, and the results come back replicated,
    so every process of a multi-host run gets the same scores.
    """

    def __init__(self, params: Any, cfg: ModelConfig, batch_size: int = 8, progress: bool = True,
                 rows_sharding: jax.sharding.NamedSharding | None = None) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size} must be at least 1")
        self.params, self.cfg, self.batch_size, self.progress = params, cfg, batch_size, progress
        self.rows_sharding = rows_sharding
        replicated = None if rows_sharding is None else NamedSharding(rows_sharding.mesh, PartitionSpec())
        self._logprobs = _compiled(cfg, replicated)

    def _place(self, rows_BT: np.ndarray) -> Any:
        if self.rows_sharding is None:
            return rows_BT
        spans = local_rows(self.rows_sharding, rows_BT.shape, dim=0)
        return global_array(self.rows_sharding, np.concatenate([rows_BT[a:b] for a, b in spans]), rows_BT.shape)

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
        rows = [window(ctx, cont, self.cfg.block_size) for ctx, cont in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        scores: list[Score | None] = [None] * len(rows)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, unit="batch", disable=not self.progress, dynamic_ncols=True, desc="scoring"):
            for i, s in zip(batch, self._score_batch([rows[i] for i in batch]), strict=True):
                scores[i] = s
        return scores  # type: ignore[return-value]

    def _score_batch(self, rows: list[tuple[list[int], int]]) -> list[Score]:
        T = bucket(max(len(tokens) - 1 for tokens, _ in rows), self.cfg.block_size)
        inputs = np.zeros((self.batch_size, T), np.int32)  # padded rows and positions: never read back
        targets = np.zeros((self.batch_size, T), np.int32)
        for r, (tokens, _) in enumerate(rows):
            inputs[r, :len(tokens) - 1], targets[r, :len(tokens) - 1] = tokens[:-1], tokens[1:]
        logp, hit = jax.device_get(self._logprobs(self.params, self._place(inputs), self._place(targets)))
        scores = []
        for r, (tokens, n) in enumerate(rows):
            span = slice(len(tokens) - 1 - n, len(tokens) - 1)
            scores.append(Score(float(np.sum(logp[r, span], dtype=np.float64)), bool(np.all(hit[r, span])), n))
        return scores
