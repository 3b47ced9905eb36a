"""Evaluate a language model on text: loss, perplexity, bits per token and per character.

Two ways to cover data (the command line is `jaxgpt eval`):

* `windows(ids, block_size)`: the whole token stream, in non-overlapping windows of `block_size`
  predictions; the last window is partial and padded, its padding masked out. Every token but the first
  is predicted once (a BPE text is preceded by end-of-text, or a BOS tokenizer's own BOS, so its first token
  is predicted too).
  Windows do not overlap, so a token early in a window sees little context: that is the usual
  trade-off of a one-pass evaluation (a sliding window would cost `block_size` times more).
* `trainer_batches(...)`: exactly the fixed evaluation batches the trainer logs as `val_loss` /
  `train_loss`, rebuilt from the run's saved config, so the two numbers can be compared directly.

Losses are summed per token in float32 on the device and accumulated in float64 on the host, so the
mean does not depend on how the tokens were batched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxgpt.data.batches import eval_batches, fixed_batches
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT
from jaxgpt.ops.loss import token_nll

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # x, y (int32, (N, T)) and which targets count (bool)


@dataclasses.dataclass(frozen=True)
class Result:
    """Summed negative log-likelihood (nats) over `tokens` predicted tokens that spell `characters` characters."""

    nats: float
    tokens: int
    characters: int

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    @property
    def bits_per_character(self) -> float:
        return self.nats / math.log(2) / self.characters

    def report(self) -> str:
        return (f"loss {self.loss:.6f} nats/token, perplexity {self.perplexity:.4f}, "
                f"{self.bits_per_token:.4f} bits/token, {self.bits_per_character:.4f} bits/character "
                f"({self.tokens:,} tokens, {self.characters:,} characters)")


def windows(ids: np.ndarray, block_size: int) -> Rows:
    """Non-overlapping rows covering `ids`: row k predicts ids[kT+1 : kT+T+1] from ids[kT : kT+T]."""
    n_targets = len(ids) - 1
    if n_targets < 1:
        raise UserError(f"the text is {len(ids)} token(s) long: evaluation needs at least two")
    n_rows = -(-n_targets // block_size)
    padded = np.zeros(n_rows * block_size + 1, np.int32)
    padded[: len(ids)] = ids
    x = padded[:-1].reshape(n_rows, block_size)
    y = padded[1:].reshape(n_rows, block_size)
    mask = (np.arange(n_rows * block_size) < n_targets).reshape(n_rows, block_size)
    return x, y, mask


def text_ids(texts: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """The token stream of several documents as `jaxgpt data` joins them (end-of-text between documents), so
    that the first token is predicted too: after an initial end-of-text when the tokenizer has one, unless it
    starts each text itself (a BOS, Llama 3's <|begin_of_text|>), which the first token is then predicted from."""
    eot = [] if tokenizer.eot_token is None else [tokenizer.eot_token]
    if not texts:
        return np.asarray(eot, np.int64)
    prefix, own = tokenizer.encode_with_prefix(texts[0])
    parts = [np.asarray([*([] if prefix else eot), *prefix, *own], np.int64)]
    parts += [np.concatenate([eot, tokenizer.encode_array(text)]).astype(np.int64) for text in texts[1:]]
    return np.concatenate(parts)


def trainer_batches(tokens: np.ndarray, settings: dict[str, Any], block_size: int, split: str) -> Rows:
    """The trainer's fixed evaluation batches of `split`, from a run's saved config (`meta["config"]`)."""
    rows = eval_batches(tokens, batch_size=settings["batch_size"] // settings["grad_accum"], block_size=block_size,
                        n_batches=settings["eval_batches"], seed=settings["seed"], split=split)
    x = np.concatenate([x for x, _ in rows])
    y = np.concatenate([y for _, y in rows])
    return x, y, np.ones(y.shape, bool)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _summed_nats(params: Any, x: jax.Array, y: jax.Array, mask: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    logits = GPT(cfg).apply({"params": params}, x).astype(jnp.float32)
    return jnp.sum(jnp.where(mask, token_nll(logits, y), 0.0))


def _batches(rows: Rows, batch_size: int) -> Iterable[Rows]:
    """Rows in batches of one shape (the last completed by masked filler rows): one compilation serves them all."""
    x, y, mask = rows
    for idx, n_real in fixed_batches(np.arange(len(x)), batch_size):
        yield x[idx], y[idx], mask[idx] & (np.arange(batch_size) < n_real)[:, None]


def evaluate(params: Any, cfg: ModelConfig, rows: Rows, characters: int, batch_size: int = 8,
             progress: bool = True) -> Result:
    """The summed loss of every counted target in `rows` (dropout off), with a progress bar over batches."""
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size} must be at least 1")
    n_batches = -(-len(rows[0]) // batch_size)
    nats = 0.0
    for x, y, mask in tqdm(_batches(rows, batch_size), total=n_batches, unit="batch", disable=not progress,
                           dynamic_ncols=True):
        nats += float(_summed_nats(params, jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask), cfg=cfg))
    return Result(nats=nats, tokens=int(rows[2].sum()), characters=characters)


def stream_characters(ids: np.ndarray, tokenizer: Tokenizer) -> int:
    """How many characters the predicted tokens of a stream (all but the first) spell."""
    return len(tokenizer.decode(ids[1:].tolist()))


def rows_characters(rows: Rows, tokenizer: Tokenizer) -> int:
    """How many characters the counted targets of `rows` spell, row by row (a BPE token cut off at a row's
    edge mid-character counts as one replacement character)."""
    _, y, mask = rows
    return sum(len(tokenizer.decode(row[keep].tolist())) for row, keep in zip(y, mask, strict=True))
