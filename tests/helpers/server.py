"""The server of the tests in this process: the app on a free port in a thread, a tiny character GPT behind it."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import openai
import uvicorn

from helpers import free_port
from helpers.models import random_params
from jaxgpt.data.conversations import ChatTemplate
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.generate import sampling
from jaxgpt.generate.engine import Engine
from jaxgpt.model.config import ModelConfig
from jaxgpt.serve.app import Served, create_app
from jaxgpt.serve.client import EngineClient
from jaxgpt.serve.core import Core

CHARS = "\n !(),.:=_abcdefghijklmnopqrstuvwxyz"


CFG = ModelConfig(vocab_size=len(CHARS), block_size=64, n_layer=2, n_head=2, n_embd=32)


TOKENIZER = CharTokenizer(CHARS)


class Server:
    """The app on a free port in a thread of this process (uvicorn, as `jaxgpt serve` runs it), its engine's side
    (`Core`) in another, joined by a pipe as `jaxgpt serve` joins its processes."""

    def __init__(self, slots: int = 4, max_waiting: int = 64, model: tuple | None = None,
                 chat_template: ChatTemplate | None = None, **served: Any) -> None:
        """`model`: (params, config, codec, specials) of another model than the tiny GPT; `served` are `Served`'s
        options (`api_key` too, and the client sends it)."""
        self.params, cfg, codec, specials = model or (random_params(CFG), CFG, TOKENIZER, None)
        self.engine = Engine(self.params, cfg, slots=slots, max_waiting=max_waiting, specials=specials,
                             eot_token=codec.eot_token)
        ours, theirs = multiprocessing.Pipe()
        self.core = threading.Thread(target=Core(self.engine, [ours]).run, daemon=True)
        self.core.start()
        self.port = free_port()
        template = chat_template.source if chat_template is not None else None
        app = create_app(EngineClient(theirs, None), Served(codec, "tiny", cfg, slots, template, **served))
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key=served.get("api_key") or "unused",
                                    max_retries=0, timeout=60)

    def expected(self, prompt: str, max_tokens: int, temperature: float, seed: int, top_p: float = 1.0) -> str:
        tokens = sampling.generate(self.params, CFG, TOKENIZER.encode(prompt), max_new_tokens=max_tokens, key=seed,
                                   temperature=temperature, top_p=top_p)[0]
        return TOKENIZER.decode(tokens.tolist())

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.core.join(timeout=30)


KEY = "sekret-key"


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
