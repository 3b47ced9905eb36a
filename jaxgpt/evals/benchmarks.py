"""HellaSwag and LAMBADA, the two benchmarks GPT-2-sized runs quote, scored with `jaxgpt.evals.loglik`.

HellaSwag (validation, 10,042 examples): a context and four endings; the model picks the ending with the
highest log-likelihood, summed (`accuracy`) or divided by the ending's token count (`accuracy_norm`, the
number nanoGPT-derived runs and llm.c report: GPT-2 124M scores about 0.295). Each ending is scored as
" " + ending after the context, as those evaluations do.

LAMBADA (OpenAI's test split, 5,153 passages): the last word of each passage given the rest; accuracy is
whether greedy decoding produces all of the word's tokens, perplexity exp(-mean log-likelihood of the word).

The data files download on first use into $JAXGPT_CACHE (default ~/.cache/jaxgpt), or are given with a path, for
offline machines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxgpt.data.corpora import download
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.data.user_files import jsonl_objects
from jaxgpt.errors import UserError
from jaxgpt.evals.loglik import Scorer
from jaxgpt.model.config import ModelConfig
from jaxgpt.storage import cache_root
from jaxgpt.train.config import EvalConfig

SOURCES = {
    "hellaswag": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
    "lambada": "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl",
}
BENCHMARKS = tuple(SOURCES)  # `jaxgpt eval --benchmark NAME`


@dataclasses.dataclass(frozen=True)
class Result:
    benchmark: str
    examples: int
    accuracy: float
    accuracy_norm: float | None = None  # HellaSwag
    perplexity: float | None = None  # LAMBADA

    def report(self) -> str:
        extra = (f", acc_norm {self.accuracy_norm:.4f}" if self.accuracy_norm is not None
                 else f", perplexity {self.perplexity:.3f}")
        return f"{self.benchmark}: {self.examples} examples, acc {self.accuracy:.4f}{extra}"


def data_file(benchmark: str, path: str | None) -> Path:
    """The benchmark's JSONL: `path` when given, else the cached download (fetched once when online)."""
    if path:
        if not Path(path).is_file():
            raise UserError(f"--data {path} does not exist: give the {benchmark} JSONL file ({SOURCES[benchmark]})")
        return Path(path)
    name = SOURCES[benchmark].rsplit("/", 1)[1]
    cached = cache_root() / name
    return download(SOURCES[benchmark], cached, f"offline, download {name} elsewhere and pass --data PATH "
                    f"(or put it at {cached})")


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    endings: tuple[str, ...]
    label: int


def read(path: str | Path) -> list[Example]:
    """HellaSwag examples from its JSONL (fields ctx, endings, label), each line checked."""
    examples = []
    for where, row in jsonl_objects(path):
        endings, label = (row.get("endings"), row.get("label")) if isinstance(row, dict) else (None, None)
        if not (isinstance(row, dict) and isinstance(row.get("ctx"), str) and isinstance(endings, list) and endings
                and all(isinstance(e, str) for e in endings)
                and isinstance(label, int) and 0 <= label < len(endings)):
            raise UserError(f"{where}: not a HellaSwag example: it needs a string ctx, a list of string "
                            "endings and an integer label indexing them")
        examples.append(Example(row["ctx"], tuple(endings), label))
    return examples


def hellaswag_requests(tokenizer: Tokenizer, examples: Sequence[Example]) -> list[tuple[list[int], list[int]]]:
    """The (context, " " + ending) token pairs to score, example by example, ending by ending (the ending
    continues the context: no BOS before it)."""
    return [(tokenizer.encode(ex.context), tokenizer.encode_continuation(" " + ending)) for ex in examples
            for ending in ex.endings]


def hellaswag(scorer: Scorer, examples: Sequence[Example], requests: Sequence[tuple[list[int], list[int]]]
              ) -> Result:
    """Accuracy over `examples` by summed and by per-token log-likelihood of their `hellaswag_requests`."""
    scores = iter(scorer.score(requests))
    hits = hits_norm = 0
    for ex in examples:
        mine = [next(scores) for _ in ex.endings]
        hits += int(np.argmax([s.logprob for s in mine]) == ex.label)
        hits_norm += int(np.argmax([s.logprob / s.tokens for s in mine]) == ex.label)
    return Result("hellaswag", len(examples), hits / len(examples), accuracy_norm=hits_norm / len(examples))


def lambada(scorer: Scorer, tokenizer: Tokenizer, records: Sequence[tuple[str, Any]]) -> Result:
    """LAMBADA's last-word accuracy and perplexity over ("FILE:LINE", {"text": ...}) records."""
    requests = []
    for where, row in records:
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or " " not in text.strip():
            raise UserError(f"{where}: not a LAMBADA passage: it needs a text field of several words")
        context, word = text.strip().rsplit(" ", 1)
        requests.append((tokenizer.encode(context), tokenizer.encode_continuation(" " + word)))
    scores = scorer.score(requests)
    mean_logprob = sum(s.logprob for s in scores) / len(scores)
    return Result("lambada", len(scores), sum(s.greedy for s in scores) / len(scores),
                  perplexity=math.exp(-mean_logprob))


class DuringTraining:
    """HellaSwag scored on a training run's sharded parameters at each of its evaluations (`config.eval`).

    The file is read and tokenized once, when the run starts (a missing file stops it before it trains).
    """

    def __init__(self, settings: EvalConfig, cfg: ModelConfig, tokenizer: Tokenizer, batch_size: int) -> None:
        path = data_file("hellaswag", settings.hellaswag_data)
        self.examples = read(path)[:settings.hellaswag_examples or None]
        if not self.examples:
            raise UserError(f"{path} holds no HellaSwag example")
        self.requests = hellaswag_requests(tokenizer, self.examples)
        self.cfg, self.batch_size = cfg, batch_size

    def __call__(self, params: Any, rows_sharding: jax.sharding.NamedSharding) -> dict[str, float]:
        """The run's accuracies on the weights `params`, its rows placed as the run's batches are."""
        scorer = Scorer(params, self.cfg, self.batch_size, progress=False, rows_sharding=rows_sharding)
        result = hellaswag(scorer, self.examples, self.requests)
        return {"hellaswag_acc": result.accuracy, "hellaswag_acc_norm": result.accuracy_norm}


def evaluate(benchmark: str, params: Any, cfg: ModelConfig, tokenizer: Tokenizer, path: Path, batch_size: int = 8,
             limit: int | None = None, progress: bool = True) -> Result:
    """Run `benchmark` ("hellaswag" or "lambada") on the JSONL at `path`, optionally its first `limit` examples."""
    scorer = Scorer(params, cfg, batch_size, progress)
    if benchmark == "hellaswag":
        examples = read(path)[:limit]
        if not examples:
            raise UserError(f"{path} holds no HellaSwag example")
        return hellaswag(scorer, examples, hellaswag_requests(tokenizer, examples))
    records = jsonl_objects(path)[:limit]
    if not records:
        raise UserError(f"{path} holds no LAMBADA passage")
    return lambada(scorer, tokenizer, records)
