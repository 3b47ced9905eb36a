"""Serve a model over HTTP with OpenAI's completions API (continuous batching over a fixed number of slots).

    jaxgpt serve --workdir runs/stdlib_char                 # http://127.0.0.1:8000/v1/completions
    jaxgpt serve --init_from hf:openai-community/gpt2 --port 8080 --slots 16
    jaxgpt serve --preset gpt2                              # random weights: for load tests
    jaxgpt serve --workdir gs://bucket/run --follow         # each new checkpoint of a run still training
    jaxgpt serve --workdir runs/base --adapter sql=runs/sql_lora --adapter chat=peft:adapters/chat

Any OpenAI client talks to it (base_url http://HOST:PORT/v1; with --api_key or JAXGPT_API_KEY set, that key,
else any; --open_paths=/tokenizer_info,/tokenize,/detokenize leaves those outside the key, for tools such as
lm-evaluation-harness's remote tokenizer that send none). /v1/chat/completions renders messages with the run's
chat_template.jinja or --chat_template FILE; /metrics is Prometheus's text format. A request's prompt and
max_tokens must fit in the model's context, or in --max_model_len (what each slot's KV cache holds: a long-context
model's slots x context may not fit in memory). An encoder-decoder run (task seq2seq) takes the source as the
prompt. A request is admitted whole or not at all: more completions (prompts x n) than --slots + --max_waiting
is a 400, more than there is room for now a 429 (docs/serving.md's limits and refusals). SIGTERM (or Ctrl-C)
stops accepting requests, finishes those in flight, exits.

The engine runs in this process and the HTTP front ends (requests, tokenizing, detokenizing, streaming) in
--api_servers processes of their own on the same port, as vLLM separates its engine core from its API servers:
the engine's thread then never waits for the front ends' interpreter lock (jaxgpt.serve.core). A spare front end
waits to replace one that dies; if the engine's process dies, the front ends answer 503 and exit.

--adapter NAME=PATH (repeatable) also serves a LoRA adapter of the served weights: a jaxgpt LoRA run's work
directory (its recorded base hash must be the served weights') or a PEFT adapter directory (peft:DIR, or a
directory with adapter_config.json). A request whose `model` is NAME decodes with it, the base's name (or none)
decodes the base alone, and rows of every adapter share the engine's batch; /v1/models lists them all, and any
other name is a 404 (without --adapter, any name is the base).

--follow polls the run every --follow_interval seconds and serves its newest checkpoint (of --which) once the
requests in flight have finished with the previous one; one that cannot be read, or whose model differs, is
one line on stderr and the previous weights stay. Answers' system_fingerprint and /v1/models say the step.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from absl import flags

from jaxgpt import storage
from jaxgpt.commands import no_arguments, run_command
from jaxgpt.commands.sample import MODEL_LOCATIONS, define_model, load_model
from jaxgpt.data.pairs import PairText
from jaxgpt.errors import UserError, optional_import
from jaxgpt.model.config import Seq2SeqConfig, decoder_of
from jaxgpt.ops.platform import keep_freed_memory

if TYPE_CHECKING:
    from jaxgpt.generate.engine import Engine
    from jaxgpt.serve.follow import Follower
    from jaxgpt.serve.launch import FrontEnds


def define(flags_: flags.FlagValues, argv: Sequence[str]) -> None:
    define_model(flags_)
    flags.DEFINE_integer("seed", 0, "the initialization of --preset", flag_values=flags_)
    flags.DEFINE_string("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)", flag_values=flags_)
    flags.DEFINE_integer("port", 8000, "port to listen on", lower_bound=0, upper_bound=65535, flag_values=flags_)
    flags.DEFINE_integer("slots", 8, "requests decoded at once (KV-cache slots)", lower_bound=1, flag_values=flags_)
    flags.DEFINE_integer("chunk", 8, "tokens each busy slot decodes per dispatch (more: less host work per token, "
                         "a longer wait for a new request's prefill)", lower_bound=1, flag_values=flags_)
    flags.DEFINE_bool("warm_up", False, "compile the decode chunk of every row count and the prefill of every "
                      "prompt bucket before listening (else the first request to reach each stalls the busy ones "
                      "for that compile)", flag_values=flags_)
    flags.DEFINE_integer("max_waiting", 64, "requests queued beyond the slots before a 429; one HTTP request may ask "
                         "for at most --slots + --max_waiting completions (prompts x n), else it is a 400",
                         lower_bound=0, flag_values=flags_)
    flags.DEFINE_string("chat_template", None, "a Jinja2 chat template (Hugging Face format) for "
                        "/v1/chat/completions, instead of the run's chat_template.jinja", flag_values=flags_)
    flags.DEFINE_string("api_key", None, "the key clients must send (Authorization: Bearer KEY) on every path but "
                        "/health, the chat page and --open_paths; default: the JAXGPT_API_KEY environment variable, "
                        "else none", flag_values=flags_)
    flags.DEFINE_list("open_paths", [], "paths answered without the API key (default: none but /health and the chat "
                      "page), e.g. /tokenizer_info,/tokenize,/detokenize for lm-evaluation-harness's "
                      "tokenizer_backend=remote, which sends no key", flag_values=flags_)
    flags.DEFINE_integer("api_servers", 1, "HTTP front-end processes sharing the port (more: more streams framed "
                         "at once; the engine is one, in this process)", lower_bound=1, flag_values=flags_)
    flags.DEFINE_bool("follow", False, "--workdir: serve each new checkpoint the run commits while it trains",
                      flag_values=flags_)
    flags.DEFINE_float("follow_interval", 5.0, "--follow: seconds between looks at the run's checkpoints",
                       lower_bound=0.05, flag_values=flags_)
    flags.DEFINE_multi_string("adapter", [], "NAME=PATH: also serve a LoRA adapter of these weights (a jaxgpt LoRA "
                              "run's work directory, or a PEFT adapter directory: peft:DIR) to requests whose model "
                              "is NAME (repeatable)", flag_values=flags_)
    flags.DEFINE_integer("max_model_len", None, "the most positions a request's prompt and new tokens may take, and "
                         "what each slot's KV cache holds (default: the model's context, whose slots x positions "
                         "may not fit in memory for a long-context model)", lower_bound=1, flag_values=flags_)
    flags.DEFINE_integer("max_body_bytes", None, "larger request bodies are a 413 (default: 1 MiB)", lower_bound=1,
                         flag_values=flags_)


def run(flags_: flags.FlagValues, args: list[str]) -> None:
    no_arguments(args)
    optional_import("uvicorn", "jaxgpt serve", package="jaxgpt[serve]")
    optional_import("fastapi", "jaxgpt serve", package="jaxgpt[serve]")
    optional_import("prometheus_client", "jaxgpt serve", package="jaxgpt[serve]")
    optional_import("jinja2", "jaxgpt serve", package="jaxgpt[serve]")
    from jaxgpt.data.conversations import load_template
    from jaxgpt.generate.adapters import stack
    from jaxgpt.generate.engine import Engine
    from jaxgpt.serve import adapters
    from jaxgpt.serve.app import Served
    from jaxgpt.serve.follow import Follower, version
    from jaxgpt.serve.launch import FrontEnds, listen

    if flags_.follow and flags_.workdir is None:
        raise UserError("--follow follows a training run's checkpoints: give it with --workdir")
    if flags_.follow and flags_.adapter:
        raise UserError("--adapter serves adapters of fixed base weights, which --follow would replace: drop one")
    keep_freed_memory()  # the engine's programs run over and over: their temporaries stay mapped on a CPU
    loaded, tokenizer = load_model(flags_)
    name = Path(flags_.workdir).name if flags_.workdir is not None else flags_.init_from or flags_.preset
    cfg, specials = loaded.model, loaded.meta.get("seq2seq")
    specs = adapters.parse(flags_.adapter, name)
    stacked = stack([adapters.load(spec, loaded) for spec in specs], cfg) if specs else None
    if isinstance(cfg, Seq2SeqConfig):  # an encoder-decoder run: the prompt is the source
        tokenizer = PairText(tokenizer, specials)
    context = decoder_of(cfg).block_size
    if flags_.max_model_len is not None and flags_.max_model_len > context:
        raise UserError(f"--max_model_len={flags_.max_model_len} is past the model's context of {context}: give at "
                        "most that, or leave it out")
    engine = Engine(loaded.params, cfg, slots=flags_.slots, max_waiting=flags_.max_waiting, chunk=flags_.chunk,
                    eot_token=tokenizer.eot_token, specials=specials, positions=flags_.max_model_len,
                    vocab_limit=tokenizer.vocab_size, adapters=stacked,
                    version=version(loaded.meta["step"]) if flags_.workdir is not None else None)
    if flags_.warm_up:
        print(f"warmed up: every row count, span and prompt bucket compiled in {engine.warm_up():.1f} s",
              flush=True)
    follower = (Follower(engine, flags_.workdir, flags_.which, loaded, flags_.follow_interval) if flags_.follow
                else None)
    api_key = flags_.api_key or os.environ.get("JAXGPT_API_KEY") or None
    limit = {"max_body_bytes": flags_.max_body_bytes} if flags_.max_body_bytes is not None else {}
    chat = loaded.meta.get("chat", {})  # a chat run's, or a Hugging Face directory's (`weights._hf_meta`)
    chat_stop_ids = tuple(chat.get("stop_ids") or [chat["end_id"]]) if chat else ()  # its ends of turn
    template = load_template(flags_.workdir, flags_.chat_template)
    if template is None and flags_.workdir is None:
        template = chat.get("template")
    served = Served(tokenizer, name, cfg, flags_.slots, chat_template=template, chat_stop_ids=chat_stop_ids,
                    chat_tokens=chat.get("tokens"), adapters=tuple((s.name, adapters.root(s)) for s in specs),
                    api_key=api_key, open_paths=tuple(flags_.open_paths), max_model_len=flags_.max_model_len,
                    **limit)
    with listen(flags_.host, flags_.port) as sock:  # open while serving: a front end that dies is replaced
        front_ends = FrontEnds(served, engine.version, sock)
        serve(engine, front_ends, front_ends.start(flags_.api_servers), follower, flags_, name, api_key, template)


def serve(engine: Engine, front_ends: FrontEnds, conns: list[Connection], follower: Follower | None,
          flags_: flags.FlagValues, name: str, api_key: str | None, template: str | None) -> None:
    """Serve until SIGTERM or Ctrl-C has had every front end finish its requests in flight."""
    from jaxgpt.serve.core import Core

    print(f"serving {name!r} {engine.version or ''} on http://{flags_.host}:{flags_.port}/v1 ({flags_.slots} slots; "
          f"{flags_.api_servers} HTTP process{'es' if flags_.api_servers > 1 else ''}; chat: "
          f"{'yes' if template else 'no template'}; API key: {'required' if api_key else 'none'}"
          f"{f'; following every {flags_.follow_interval:g} s' if follower else ''}"
          f"{'; adapters: ' + ', '.join(engine.adapters.names) if engine.adapters else ''})", flush=True)

    finish = lambda *_: front_ends.stop()  # each front end finishes its requests in flight, then closes its end
    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    if follower is not None:
        follower.start()
    try:
        Core(engine, conns, replace=front_ends.replace).run()  # until every front end has closed
    finally:
        finish()
        if follower is not None:
            follower.stop()  # (a checkpoint being loaded is loaded first)
        front_ends.join()


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(__doc__, define, run, argv, {**MODEL_LOCATIONS, "chat_template": storage.ANYWHERE})


if __name__ == "__main__":
    sys.exit(main())
