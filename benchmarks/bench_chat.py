"""A chat run's held-out exact match, asked the way a client asks: `jaxgpt serve`'s /v1/chat/completions.

    python benchmarks/bench_chat.py --workdir runs/chat_sft                       # and its base model, for comparison
    python benchmarks/bench_chat.py --workdir runs/chat_sft --limit 200 --base ""  # the fine-tuned run only

The held-out conversations are those the run's evaluation scores (`jaxgpt.tasks.chat.held_out_conversations` of
its config.json: the same generator, seed and split). Each is sent without its last assistant turn to a
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
import socket
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from jaxgpt.data.conversations import TEMPLATE_FILE, Conversation
from jaxgpt.tasks.chat import held_out_conversations
from jaxgpt.train.config import ChatConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: str, port: int, slots: int, template: str | None) -> subprocess.Popen:
    """`jaxgpt serve` on `workdir`, once /health answers."""
    command = [sys.executable, "-m", "jaxgpt", "serve", "--workdir", workdir, "--port", str(port), "--slots",
               str(slots), *(["--chat_template", template] if template else [])]
    server = subprocess.Popen(command)
    deadline = time.time() + 600
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"bench_chat: `{' '.join(command)}` exited with status {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(1)
    server.kill()
    raise SystemExit(f"bench_chat: `{' '.join(command)}` did not answer /health within 600 s")


def ask_all(workdir: str, conversations: list[tuple[Conversation, str]], args: argparse.Namespace,
            template: str | None = None) -> tuple[dict[str, list[bool]], float]:
    """Whether each reply equals its reference, by kind, and the seconds the requests took."""
    port = free_port()
    server = start_server(workdir, port, args.slots, template)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

    def ask(conversation: Conversation) -> bool:
        reply = client.chat.completions.create(model="run", messages=conversation[:-1], temperature=0,
                                               max_tokens=args.max_tokens)
        return reply.choices[0].message.content == conversation[-1]["content"]

    try:
        start = time.time()
        with ThreadPoolExecutor(args.slots) as pool:
            right = list(pool.map(ask, [c for c, _ in conversations]))
        seconds = time.time() - start
    finally:
        server.terminate()
        server.wait(60)
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
    conversations = held_out_conversations(ChatConfig(**config["chat"]), config["seed"])
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
