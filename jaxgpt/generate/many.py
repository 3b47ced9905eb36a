"""Batched generation over the continuous-batching engine: prompts of different lengths and settings in, their
new tokens out, the engine run to completion in the caller's thread (what `sample.py --prompt_file`, chat
evaluations, RL rollouts and DPO's rejected replies use)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from jaxgpt.generate.engine import Engine, Request
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig


def generate_many(params: Any, cfg: ModelConfig | Seq2SeqConfig, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: int | Sequence[int], seeds: int | Sequence[int] = 0,
                  temperature: float | Sequence[float] = 1.0, top_p: float | Sequence[float] = 1.0,
                  eot_token: int | None = None, vocab_limit: int | None = None, slots: int = 8,
                  until: Callable[[int, list[int]], bool] | None = None, progress: bool = False,
                  specials: dict[str, int] | None = None) -> list[list[int]]:
    """New tokens for prompts of different lengths, `slots` at a time; every setting is one value or one per row.

    Row r samples what `generate(params, cfg, prompts[r], key=seeds[r], ...)` samples for it alone (an
    encoder-decoder's prompts are sources, with its `specials`: `seq2seq.sample`/`greedy` of the source). A row
    ends at `eot_token` (eos; included), after its max_new_tokens, or when `until(r, tokens so far)` says so.
    """
    n = len(prompts)
    per_row = lambda v: list(v) if isinstance(v, Sequence) else [v] * n
    settings = list(zip(per_row(max_new_tokens), per_row(seeds), per_row(temperature), per_row(top_p), strict=True))
    # caches of the positions these requests write, not of the model's whole context (8k for SmolLM2)
    positions = max((len(p) + count for p, (count, *_) in zip(prompts, settings, strict=True)), default=1)
    engine = Engine(params, cfg, slots=slots, max_waiting=n, eot_token=eot_token, vocab_limit=vocab_limit,
                    specials=specials, positions=positions)
    out: list[list[int]] = [[] for _ in range(n)]
    bar = tqdm(total=n, unit="request", disable=not progress, dynamic_ncols=True)
    for r, (prompt, (count, seed, temp, p)) in enumerate(zip(prompts, settings, strict=True)):
        engine.check(list(prompt), count, temp, p)
        request = Request(list(prompt), count, temperature=temp, top_p=p, seed=seed, emit=lambda *_: None,
                          done=lambda _: bar.update(), logprobs=False)  # tokens only: no log-softmax, no top-k

        def emit(token: int, _logprob: float, _top: list, _end: bool, r: int = r, request: Request = request) -> None:
            out[r].append(token)
            if until is not None and until(r, out[r]):
                request.cancelled = True

        request.emit = emit
        engine.submit(request)
    engine.drain()
    bar.close()
    return out
