"""Evaluation streams and benchmark requests of a tokenizer that puts a BOS before every text (Llama 3's
<|begin_of_text|>): the text starts with its own BOS, never end-of-text first, and a continuation has none."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.bos_tokenizer import bos_tokenizer

from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.evals.benchmarks import Example, hellaswag_requests
from jaxgpt.evals.text import stream_characters, text_ids

pytest.importorskip("tokenizers")
DOCS = ["the answer is 42", "hello world"]


def test_a_bos_tokenizers_stream_starts_with_its_bos_and_separates_documents_as_jaxgpt_data_does():
    tok = bos_tokenizer()
    bos, eot = tok.bos_token, tok.eot_token
    ids = text_ids(DOCS, tok).tolist()
    first, second = (tok.encode_continuation(d) for d in DOCS)
    assert ids == [bos, *first, eot, bos, *second]
    assert stream_characters(np.asarray(ids), tok) == len("".join(DOCS)) + len("<|end_of_text|><|begin_of_text|>")


def test_a_tokenizer_without_bos_still_starts_with_end_of_text():
    tok = bos_tokenizer()
    plain = JsonTokenizer(tok.json_text, eot_token=tok.eot_token)
    ids = text_ids(DOCS, plain).tolist()
    assert ids == [tok.eot_token, *plain.encode(DOCS[0]), tok.eot_token, *plain.encode(DOCS[1])]


def test_benchmark_endings_continue_their_context_without_a_bos():
    tok = bos_tokenizer()
    requests = hellaswag_requests(tok, [Example("the answer", ("is 42", "hello"), 0)])
    assert [tok.decode(context + ending) for context, ending in requests] == [
        "<|begin_of_text|>the answer is 42", "<|begin_of_text|>the answer hello"]
    assert all(tok.bos_token not in ending for _, ending in requests)


@pytest.mark.torch
def test_harness_rolling_windows_start_from_the_bos_not_end_of_text_then_bos():
    """lm-evaluation-harness's perplexity tasks: the first window is conditioned on the BOS, which is not scored."""
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from lm_eval.api.model import CacheHook

    from jaxgpt.evals.harness import JaxGPTLM

    tok = bos_tokenizer()
    lm = JaxGPTLM.__new__(JaxGPTLM)
    lm.tokenizer, lm.cfg, lm.cache_hook, pieces = tok, SimpleNamespace(block_size=64), CacheHook(None), []
    lm._loglikelihood_tokens = lambda p, disable_tqdm=False: pieces.extend(p) or [(-1.0, True)] * len(p)
    assert lm.loglikelihood_rolling([SimpleNamespace(args=(DOCS[0],))], disable_tqdm=True) == [-1.0]
    [(_, context, scored)] = pieces
    assert context == [tok.bos_token] and scored == tok.encode_continuation(DOCS[0])
