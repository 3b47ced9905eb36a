"""A chat run's held-out exact match, asked the way a client asks: `jaxgpt serve`'s /v1/chat/completions.

    python benchmarks/bench_chat.py --workdir runs/chat_sft                       # and its base model, for comparison
    python benchmarks/bench_chat.py --workdir runs/chat_sft --limit 200 --base ""  # the fine-tuned run only

The held-out conversations are those the run's evaluation scores (`jaxgpt.tasks.chat.held_out_conversations` of
its config.json, tokenizer and context: the same generator, seed and split of the conversations that fit, each up
to its last assistant turn that fits). Each is sent without its last assistant turn to a
`jaxgpt serve` subprocess on 127.0.0.1 through the openai client, greedy (temperature 0), several at a time so
the engine batches them; a reply is right when its text equals the reference answer exactly (the server ends a
reply at the chat end token, which is not part of the text). The base model (the run's init_from, a jaxgpt run)
gets the same conversations through the same endpoint, rendered by the fine-tuned run's chat template with
`--chat_template`: its tokenizer has no chat tokens, so they reach it as plain text, and its replies end at
--max_tokens. Accuracy is printed per task and overall for each model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # `jaxgpt serve` started as the tests do
from helpers import serving

from jaxgpt.data.conversations import TEMPLATE_FILE, Conversation
from jaxgpt.data.tokenizer import tokenizer_from_meta
from jaxgpt.io import weights
from jaxgpt.tasks.chat import held_out_conversations
from jaxgpt.train.config import ChatConfig


def ask_all(workdir: str, conversations: list[tuple[Conversation, str]], args: argparse.Namespace,
            template: str | None = None) -> tuple[dict[str, list[bool]], float]:
    """Whether each reply equals its reference, by kind, and the seconds the requests took."""
    options = ["--workdir", workdir, "--slots", str(args.slots), *(["--chat_template", template] if template else [])]
    with serving(*options, timeout=600) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        def ask(conversation: Conversation) -> bool:
            reply = client.chat.completions.create(model="run", messages=conversation[:-1], temperature=0,
                                                   max_tokens=args.max_tokens)
            return reply.choices[0].message.content == conversation[-1]["content"]

        start = time.time()
        with ThreadPoolExecutor(args.slots) as pool:
            right = list(pool.map(ask, [c for c, _ in conversations]))
        seconds = time.time() - start
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for ok, (_, kind) in zip(right, conversations, strict=True):
        by_kind[kind].append(ok)
    return by_kind, seconds


def report(name: str, by_kind: dict[str, list[bool]], seconds: float) -> None:
    every = [ok for oks in by_kind.values() for ok in oks]
    tasks = ", ".join(f"{kind} {sum(oks) / len(oks):.3f}" for kind, oks in sorted(by_kind.items()))
    print(f"{name}: exact match {sum(every) / len(every):.3f} on {len(every)} held-out conversations ({tasks}); "
          f"{len(every) / seconds:.1f} requests/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/chat_sft", help="a run of task chat")
    parser.add_argument("--base", default=None, help="the base run to compare (default: the run's init_from "
                        "workdir; empty: none)")
    parser.add_argument("--limit", type=int, default=0, help="the first N held-out conversations (0: all)")
    parser.add_argument("--slots", type=int, default=16, help="the server's slots, and the requests in flight")
    parser.add_argument("--max_tokens", type=int, default=24)
    args = parser.parse_args()
    config = json.loads((Path(args.workdir) / "config.json").read_text())
    if config.get("task") != "chat":
        raise SystemExit(f"bench_chat: {args.workdir} is a run of task {config.get('task')!r}, not chat")
    model, tokenizer_meta = weights.describe(f"workdir:{args.workdir}")
    tokenizer = tokenizer_from_meta(tokenizer_meta, config["data"]["bpe_file"] or None)
    conversations = held_out_conversations(ChatConfig(**config["chat"]), config["seed"], tokenizer, model.block_size)
    conversations = conversations[:args.limit or None]
    print(f"{args.workdir}: {len(conversations)} held-out conversations of {config['chat']['data']} "
          f"(seed {config['seed']}), greedy, through /v1/chat/completions")
    report(f"fine-tuned ({args.workdir})", *ask_all(args.workdir, conversations, args))
    base = config["init_from"].removeprefix("workdir:") if args.base is None else args.base
    if base and not base.startswith(("hf:", "preset:")):
        template = str(Path(args.workdir) / TEMPLATE_FILE)
        report(f"base ({base}, the same prompts as text)", *ask_all(base, conversations, args, template))


if __name__ == "__main__":
    main()
