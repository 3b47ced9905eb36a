"""What a request to the continuous-batching engine (`jaxgpt.generate.engine`) must satisfy: checked before it is
queued, so that a server answers a bad one with a 400 and the engine's thread never meets it."""

from __future__ import annotations

from jaxgpt.data.tokenizer_base import out_of_range
from jaxgpt.errors import UserError
from jaxgpt.generate.sampling import validate_options
from jaxgpt.model.config import ModelConfig, Seq2SeqConfig


def check_request(cfg: ModelConfig | Seq2SeqConfig, prompt: list[int], max_new_tokens: int, temperature: float,
                  top_p: float, context: int | None = None) -> None:
    """A UserError for a request the engine cannot run (the server answers it with a 400). An encoder-decoder's
    prompt is its source: at most src_block_size tokens, and max_tokens at most the decoder's context. A GPT's
    request may ask for 0 new tokens (only its prompt is scored). `context`: the positions a request may use (a
    server's --max_model_len; None: the model's block_size)."""
    scores_only = max_new_tokens == 0 and not isinstance(cfg, Seq2SeqConfig)
    validate_options(1 if scores_only else max_new_tokens, temperature, None, top_p)
    if not prompt:
        raise UserError("the prompt is empty: give at least one token")
    if isinstance(cfg, Seq2SeqConfig):
        if len(prompt) > cfg.src_block_size or max_new_tokens > (context := context or cfg.model.block_size):
            raise UserError(f"the source's {len(prompt)} tokens or max_tokens={max_new_tokens} exceed the model's "
                            f"src_block_size={cfg.src_block_size} / block_size={context}: shorten them")
        vocab_size = cfg.src_vocab_size
    elif len(prompt) + max_new_tokens > (context := context or cfg.block_size):
        raise UserError(f"the prompt's {len(prompt)} tokens plus max_tokens={max_new_tokens} exceed the model's "
                        f"context of {context}: shorten the prompt or ask for fewer tokens")
    else:
        vocab_size = cfg.vocab_size
    if bad := out_of_range(prompt, vocab_size):
        raise UserError(f"prompt token ids {bad} are outside the vocabulary [0, {vocab_size})")
