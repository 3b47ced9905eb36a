"""Serve a model over HTTP with OpenAI's completions API (continuous batching over a fixed number of slots).

    jaxgpt serve --workdir runs/stdlib_char                 # http://127.0.0.1:8000/v1/completions
    jaxgpt serve --init_from hf:openai-community/gpt2 --port 8080 --slots 16
    jaxgpt serve --preset gpt2                              # random weights: for load tests

Any OpenAI client talks to it (base_url http://HOST:PORT/v1, any api_key). A request's prompt and max_tokens
must fit in the model's context. An encoder-decoder run (task seq2seq) takes the source as the
prompt. SIGTERM (or Ctrl-C) stops accepting requests, finishes those in flight, exits.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxgpt.commands import no_arguments, run_command
from jaxgpt.commands.sample import MODEL_LOCATIONS, define_model, load_model
from jaxgpt.errors import optional_import
from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.tasks.pairs import PairText


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    define_model(flags_)
    flags.DEFINE_integer("seed", 0, "the initialization of --preset", flag_values=flags_)
    flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)", flag_values=flags_)
    flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=0, upper_bound=65535, flag_values=flags_)
    flags.DEFINE_integer("slots", 8, "requests decoded at once (KV-cache slots)", lower_bound=1, flag_values=flags_)
    flags.DEFINE_integer("max_waiting", 64, "requests queued beyond the slots before a 429", lower_bound=0,
                         flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    no_arguments(args)
    uvicorn = optional_import("uvicorn", "jaxgpt serve", package="jaxgpt[serve]")
    optional_import("fastapi", "jaxgpt serve", package="jaxgpt[serve]")
    from jaxgpt.generate.engine import Engine
    from jaxgpt.serve.app import create_app

    loaded, tokenizer = load_model(flags_)
    name = Path(flags_.workdir).name if flags_.workdir is not None else flags_.init_from or flags_.preset
    cfg, specials = loaded.model, loaded.meta.get("seq2seq")
    if isinstance(cfg, Seq2SeqConfig):  # an encoder-decoder run: the prompt is the source
        tokenizer = PairText(tokenizer, specials)
    vocab = cfg.model.vocab_size if isinstance(cfg, Seq2SeqConfig) else cfg.vocab_size
    engine = Engine(loaded.params, cfg, slots=flags_.slots, max_waiting=flags_.max_waiting,
                    eot_token=tokenizer.eot_token, specials=specials,
                    vocab_limit=tokenizer.vocab_size if tokenizer.vocab_size < vocab else None)
    print(f"serving {name!r} on http://{flags_.host}:{flags_.port}/v1 ({flags_.slots} slots)", flush=True)
    uvicorn.run(create_app(engine, tokenizer, name), host=flags_.host, port=flags_.port, log_level="warning",
                timeout_graceful_shutdown=60)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, MODEL_LOCATIONS)


if __name__ == "__main__":
    sys.exit(main())
