"""jaxgpt as an lm-evaluation-harness model, registered under the name "jaxgpt".

    import jaxgpt.evals.harness                      # registers the model with the harness
    lm_eval.simple_evaluate(model="jaxgpt", model_args="workdir=runs/x,batch_size=16", tasks=["hellaswag"])
    jaxgpt harness --model_args workdir=runs/x --tasks hellaswag    # the harness's own command line

The harness (0.4.13) finds models only in its registry, which it fills from its own table: it reads no
entry points, so the registration happens when this module is imported, and `jaxgpt harness` imports it
before handing its arguments to the harness's command line.

Weights come through the one weight loader (`workdir=`, `init_from=hf:...`, `preset=`). Requests are
tokenized by the harness's `TemplateLM` rules (trailing context spaces move to the continuation, an empty
context is conditioned on end-of-text), so a model exported to Hugging Face and evaluated as `hf` scores the
same tokens; scoring is `jaxgpt.evals.loglik`, generation the KV-cache sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxgpt.errors import UserError
from jaxgpt.evals.loglik import Scorer
from jaxgpt.generate.sampling import generate
from jaxgpt.io import weights


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """The text before the first occurrence of any stop string."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


@register_model("jaxgpt")
class JaxGPTLM(TemplateLM):
    """A jaxgpt GPT behind the harness's `LM` interface."""

    def __init__(self, workdir: str | None = None, init_from: str | None = None, preset: str | None = None,
                 which: str = "latest", dtype: str | None = None, batch_size: int | str = 8,
                 max_gen_toks: int = 256, bpe_file: str | None = None, **_harness: Any) -> None:
        super().__init__()
        source = weights.source_of(workdir, init_from, preset)
        loaded = weights.load(source, which=which)
        self.cfg = weights.require_gpt(source, loaded.model, "be evaluated as a language model")
        if dtype not in (None, "float32", "bfloat16"):
            raise UserError(f"dtype={dtype} is not one of float32, bfloat16")
        self.cfg = self.cfg.replace(dtype=dtype) if dtype else self.cfg
        self.params, self.tokenizer = loaded.params, loaded.tokenizer(bpe_file)
        if self.tokenizer.eot_token is None:
            raise UserError(f"{loaded.description} has no end-of-text token, which the harness conditions empty "
                            "contexts on: evaluate a GPT-2 BPE or word-level model")
        self.scorer = Scorer(self.params, self.cfg, int(batch_size) if str(batch_size).isdigit() else 8)
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_token

    @property
    def max_length(self) -> int:
        return self.cfg.block_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], **_: Any) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        self.scorer.progress = not disable_tqdm
        scores = self.scorer.score([(ctx, cont) for _, ctx, cont in requests])
        answers = [(s.logprob, s.greedy) for s in scores]
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's summed log-likelihood over disjoint windows of the context, the first conditioned on the
        BOS a tokenizer puts before a text, else on end-of-text (the harness's own windowing)."""
        pieces, owner = [], []
        for i, req in enumerate(requests):
            prefix, ids = self.tokenizer.encode_with_prefix(req.args[0])
            windows = get_rolling_token_windows(token_list=ids, prefix_token=(prefix or [self.eot_token_id])[0],
                                                max_seq_len=self.max_length, context_len=1)
            for pair in map(make_disjoint_window, windows):
                pieces.append((None, *pair))
                owner.append(i)
        scores = self._loglikelihood_tokens(pieces, disable_tqdm=disable_tqdm)
        totals = np.zeros(len(requests))
        np.add.at(totals, owner, [logprob for logprob, _ in scores])
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), float(total))
        return totals.tolist()

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations from the KV-cache sampler, cut at the request's stop strings."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generating", dynamic_ncols=True):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            stops = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
            n_new = min(int(kwargs.pop("max_gen_toks")), self.max_length - 1)
            prompt = self.tok_encode(context)[-(self.max_length - n_new):] or [self.eot_token_id]
            new = generate(self.params, self.cfg, np.asarray(prompt, np.int32), max_new_tokens=n_new,
                           temperature=float(kwargs.get("temperature", 0.0)), key=int(kwargs.get("seed", 0)),
                           eot_token=self.eot_token_id)[0]
            text = cut_at_stops(self.tok_decode(new.tolist()), stops)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
