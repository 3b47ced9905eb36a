"""Serving throughput on this machine, measured in one run: `jaxgpt serve`'s app under concurrent clients,
and a batch of ragged prompts through the engine vs transformers' padded `generate`.

    python benchmarks/bench_serve.py                 # both models, 1 / 4 / 16 clients
    python benchmarks/bench_serve.py --requests 2    # fewer requests per client (quicker)

Part 1: the app (`jaxgpt.serve.app`, 16 slots) on 127.0.0.1 with random weights of the quick start's model
(configs/stdlib_char.py: 4 layers x 4 heads x 128 wide, 256 characters of context) and of the 6 x 6 x 384 one,
driven by N client threads of the official `openai` client, each sending --requests
completions (prompts of 8-64 characters, 64 new tokens, temperature 1) one after another. Printed per N:
aggregate completion tokens/s over the wall time, and p50 / p99 request latency. Target (issue 28): with 16
clients, aggregate tokens/s >= 4x one client's.
Part 2: 32 ragged prompts, 48 greedy new tokens each, through `engine.generate_many` (what `sample.py
--prompt_file` runs) with 16 slots, and through transformers' `generate` on the same weights exported with
`save_hf_gpt2`, left-padded in batches of 16 with an attention mask; tokens/s of each and how many rows agree.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from jaxgpt.data.tokenizer import CharTokenizer  # noqa: E402
from jaxgpt.generate.engine import Engine, generate_many  # noqa: E402
from jaxgpt.model.config import ModelConfig  # noqa: E402
from jaxgpt.model.gpt import init_params  # noqa: E402
from jaxgpt.serve.app import create_app  # noqa: E402

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # a sorted character vocabulary of 96
NEW_TOKENS = 64


def models() -> dict[str, ModelConfig]:
    from configs.stdlib_char import get_config  # the quick start's model

    quick = get_config().model
    return {"quick start " + f"{quick.n_layer}x{quick.n_head}x{quick.n_embd}":
            ModelConfig(vocab_size=len(CHARS), block_size=quick.block_size, n_layer=quick.n_layer,
                        n_head=quick.n_head, n_embd=quick.n_embd),
            "6x6x384": ModelConfig(vocab_size=len(CHARS), block_size=256, n_layer=6, n_head=6, n_embd=384)}


def serve(cfg: ModelConfig, params: dict) -> tuple[uvicorn.Server, int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = Engine(params, cfg, slots=16, max_waiting=256)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, CharTokenizer(CHARS), "m"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, port


def load(port: int, clients: int, requests: int, rng: np.random.Generator) -> tuple[float, list[float]]:
    """(aggregate tokens/s, request latencies) of `clients` threads sending `requests` completions each."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = ["".join(rng.choice(list(CHARS[1:]), int(n))) for n in rng.integers(8, 65, clients * requests)]

    def one_client(c: int) -> tuple[int, list[float]]:
        tokens, latencies = 0, []
        for i in range(requests):
            t = time.perf_counter()
            got = client.completions.create(model="m", prompt=prompts[c * requests + i], max_tokens=NEW_TOKENS,
                                            temperature=1.0, seed=c * requests + i)
            latencies.append(time.perf_counter() - t)
            tokens += got.usage.completion_tokens
        return tokens, latencies

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one_client, range(clients)))
    wall = time.perf_counter() - t0
    return sum(t for t, _ in results) / wall, [x for _, lat in results for x in lat]


def part1(args: argparse.Namespace) -> None:
    print(f"{'model':<26}{'clients':>8}{'tokens/s':>11}{'x 1 client':>12}{'p50 s':>8}{'p99 s':>8}")
    for name, cfg in models().items():
        server, port = serve(cfg, init_params(cfg, jax.random.key(0)))
        rng = np.random.default_rng(0)
        load(port, 16, 1, rng)  # compiles every prefill bucket and the step
        one = None
        for clients in (1, 4, 16):
            rate, latencies = load(port, clients, args.requests, rng)
            one = one or rate
            p50, p99 = np.percentile(latencies, [50, 99])
            print(f"{name:<26}{clients:>8}{rate:>11,.0f}{rate / one:>11.2f}x{p50:>8.2f}{p99:>8.2f}")
        verdict = "meets" if rate >= 4 * one else "misses"
        print(f"{name}: 16 clients {rate / one:.2f}x one client's tokens/s ({verdict} the 4x target)")
        server.should_exit = True


def part2() -> None:
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError:
        print("transformers is not installed: part 2 skipped")
        return
    from jaxgpt.io.hf import save_hf_gpt2

    cfg = models()["6x6x384"]
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, len(CHARS), int(n)).tolist() for n in rng.integers(4, 120, 32)]
    generate_many(params, cfg, prompts[:16], max_new_tokens=4, temperature=0.0, slots=16)  # compile
    t = time.perf_counter()
    ours = generate_many(params, cfg, prompts, max_new_tokens=48, temperature=0.0, slots=16)
    ours_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_gpt2(params, cfg, Path(tmp) / "hf")
        model = GPT2LMHeadModel.from_pretrained(Path(tmp) / "hf").eval()
    torch.set_num_threads(os.cpu_count() or 1)
    theirs, theirs_s = [], 0.0
    with torch.inference_mode():
        for start in range(0, len(prompts), 16):
            batch = prompts[start:start + 16]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            theirs_s += time.perf_counter() - t
            theirs += out[:, width:].tolist()
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    n = 48 * len(prompts)
    print(f"32 ragged prompts (4-119 tokens) x 48 greedy tokens, 6x6x384: generate_many (16 slots) {n / ours_s:,.0f} "
          f"tokens/s, transformers padded generate (batches of 16) {n / theirs_s:,.0f} tokens/s: "
          f"{theirs_s / ours_s:.2f}x; identical rows {agree} of {len(prompts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4, help="completions per client")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    part1(args)
    part2()


if __name__ == "__main__":
    main()
