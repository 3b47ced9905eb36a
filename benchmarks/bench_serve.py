"""Serving speed on this machine, measured in one run: `jaxgpt serve`'s app under concurrent streaming clients,
against `generate` alone on the same model, and a batch of ragged prompts through the engine vs transformers'
padded `generate`.

    python benchmarks/bench_serve.py                 # both models, 1 / 4 / 16 clients
    python benchmarks/bench_serve.py --requests 2    # fewer requests per client (quicker)
    python benchmarks/bench_serve.py --quick         # the quick start's model only, no transformers part

Part 1: the app (`jaxgpt.serve.app`, 16 slots) on 127.0.0.1 with random weights of the quick start's model
(configs/stdlib_char.py: 4 layers x 4 heads x 128 wide, 256 characters of context) and of the 6 x 6 x 384 one,
driven by N client threads of the official `openai` client in a process of their own, each streaming --requests
completions (prompts of 8-64 characters, 64 new tokens, temperature 1, stream_options.include_usage) one after
another. First, `generate` alone (`jaxgpt.generate.sampling.generate`, what `sample.py` runs) on the same prompts
one after another: its tokens/s, prefill included, is what one client could get with no server at all. Then the
engine alone (its loop in this process, no HTTP) on the same kind of requests, one at a time and 16 at once: the
most the server can reach on this machine, so the clients' ratios below show what HTTP costs. Printed per N:
aggregate completion tokens/s over the wall time, that over one client's and over `generate` alone's, and the
p50 / p99 of time to first token (request sent to first text chunk) and of inter-token latency (between the
chunks of one stream, divided by the tokens each brought). Targets (issue 36): one client >= 0.6x `generate`
alone, 16 clients >= 8x one client.
Part 2: 32 ragged prompts, 48 greedy new tokens each, through `engine.generate_many` (what `sample.py
--prompt_file` runs) with 16 slots, and through transformers' `generate` on the same weights exported with
`save_hf`, left-padded in batches of 16 with an attention mask; tokens/s of each and how many rows agree.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
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
from jaxgpt.generate.engine import Engine, Request, generate_many  # noqa: E402
from jaxgpt.generate.sampling import generate  # noqa: E402
from jaxgpt.model.config import ModelConfig  # noqa: E402
from jaxgpt.model.gpt import init_params  # noqa: E402
from jaxgpt.ops.platform import keep_freed_memory  # noqa: E402
from jaxgpt.serve.app import create_app  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from tests_helpers import free_port  # noqa: E402

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # a sorted character vocabulary of 96
NEW_TOKENS = 64
PROMPT_CHARS = (8, 64)  # the shortest and longest prompt


def models() -> dict[str, ModelConfig]:
    from configs.stdlib_char import get_config  # the quick start's model

    quick = get_config().model
    return {"quick start " + f"{quick.n_layer}x{quick.n_head}x{quick.n_embd}":
            ModelConfig(vocab_size=len(CHARS), block_size=quick.block_size, n_layer=quick.n_layer,
                        n_head=quick.n_head, n_embd=quick.n_embd),
            "6x6x384": ModelConfig(vocab_size=len(CHARS), block_size=256, n_layer=6, n_head=6, n_embd=384)}


def warmed_engine(cfg: ModelConfig, params: dict) -> Engine:
    engine = Engine(params, cfg, slots=16, max_waiting=256)
    # every row count's and span's chunk, and every prompt bucket, of the requests `load` sends
    engine.warm_up(prompt_lengths=range(PROMPT_CHARS[0], PROMPT_CHARS[1] + 1), max_new_tokens=NEW_TOKENS)
    return engine


def serve(engine: Engine) -> tuple[uvicorn.Server, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, CharTokenizer(CHARS), "m"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, port


def engine_alone(engine: Engine, at_once: int, requests: int, seed: int) -> float:
    """Tokens/s of the engine itself (no HTTP, its loop in this thread) on `at_once` * `requests` of the
    clients' requests, `at_once` decoding together: what the server could give that many clients at most."""
    prompts = [CharTokenizer(CHARS).encode(p) for p in prompts_for(at_once * requests, np.random.default_rng(seed))]
    t = time.perf_counter()
    for start in range(0, len(prompts), at_once):
        for i, p in enumerate(prompts[start:start + at_once], start):
            engine.submit(Request(p, NEW_TOKENS, emit=lambda *_: None, done=lambda _: None, temperature=1.0, seed=i,
                                  logprobs=False, ignore_eos=True))
        if at_once == 1:  # one client: the next request once this one has ended
            engine.drain()
    engine.drain()  # many: the queue refills each slot as it frees, as clients that send again at once would
    return NEW_TOKENS * len(prompts) / (time.perf_counter() - t)


class Load:
    """What `clients` threads streaming `requests` completions each measured."""

    def __init__(self, tokens: int, wall: float, first: list[float], gaps: list[float]) -> None:
        self.rate = tokens / wall
        self.first_p50, self.first_p99 = np.percentile(first, [50, 99])
        self.gap_p50, self.gap_p99 = np.percentile(gaps, [50, 99]) if gaps else (float("nan"), float("nan"))


def prompts_for(n: int, rng: np.random.Generator) -> list[str]:
    return ["".join(rng.choice(list(CHARS[1:]), int(k))) for k in rng.integers(PROMPT_CHARS[0], PROMPT_CHARS[1] + 1, n)]


def load(port: int, clients: int, requests: int, seed: int) -> Load:
    """Stream `requests` completions from each of `clients` threads, one after another, timing every chunk. Run in
    a process of its own (`part1`), as clients are: their parsing then holds no lock the server needs."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = prompts_for(clients * requests, np.random.default_rng(seed))

    def one_request(i: int) -> tuple[int, float, list[float]]:
        """(completion tokens, time to first token, inter-token latencies) of request i."""
        sent = time.perf_counter()
        last, first, gaps, tokens = None, 0.0, [], 0
        for chunk in client.completions.create(model="m", prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=1.0,
                                               seed=i, stream=True, stream_options={"include_usage": True}):
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if last is None:
                first = now - sent
            else:  # a chunk's text is one token here (characters), unless the server sent several at once
                gaps += [(now - last) / len(chunk.choices[0].text)] * len(chunk.choices[0].text)
            last = now
        return tokens, first, gaps

    def one_client(c: int) -> list[tuple[int, float, list[float]]]:
        return [one_request(c * requests + i) for i in range(requests)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rows in pool.map(one_client, range(clients)) for r in rows]
    wall = time.perf_counter() - t0
    return Load(sum(t for t, _, _ in results), wall, [f for _, f, _ in results], [g for *_, gs in results for g in gs])


def alone(cfg: ModelConfig, params: dict, requests: int, rng: np.random.Generator) -> float:
    """Tokens/s of `generate` alone on prompts like the clients', one after another (compiled first)."""
    prompts = [CharTokenizer(CHARS).encode(p) for p in prompts_for(requests, rng)]
    run = lambda i, p: generate(params, cfg, p, max_new_tokens=NEW_TOKENS, key=i, temperature=1.0)
    for i, p in enumerate(prompts):  # one compile per prompt length
        run(i, p)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        run(i, p)
    return NEW_TOKENS * len(prompts) / (time.perf_counter() - t)


def part1(args: argparse.Namespace) -> None:
    keep_freed_memory()  # as `jaxgpt serve` does
    names = list(models().items())[:1 if args.quick else None]
    for name, cfg in names:
        params = init_params(cfg, jax.random.key(0))
        engine = warmed_engine(cfg, params)
        base = alone(cfg, params, 16, np.random.default_rng(1))
        print(f"{name}: generate alone {base:,.0f} tokens/s (batch 1, 64 new tokens, prefill included)")
        solo, many = (engine_alone(engine, n, args.requests, seed=n) for n in (1, 16))
        print(f"{name}: the engine alone (no HTTP) {solo:,.0f} tokens/s one request at a time ({solo / base:.2f}x "
              f"generate), {many:,.0f} with 16 at once ({many / solo:.2f}x): the most the server can reach here")
        server, port = serve(engine)
        print(f"{'clients':>8}{'tokens/s':>11}{'x 1 client':>12}{'x generate':>12}{'TTFT p50':>10}{'p99 s':>8}"
              f"{'ITL p50':>10}{'p99 ms':>8}")
        one = None
        for clients in (1, 4, 16):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as proc:
                got = proc.submit(load, port, clients, args.requests, clients).result()
            one = one or got
            print(f"{clients:>8}{got.rate:>11,.0f}{got.rate / one.rate:>11.2f}x{got.rate / base:>11.2f}x"
                  f"{got.first_p50:>10.3f}{got.first_p99:>8.3f}{got.gap_p50 * 1e3:>10.2f}{got.gap_p99 * 1e3:>8.2f}")
        print(f"{name}: one client {one.rate / base:.2f}x generate alone (target >= 0.6x: "
              f"{'meets' if one.rate >= 0.6 * base else 'misses'}); 16 clients {got.rate / one.rate:.2f}x one "
              f"client (target >= 8x: {'meets' if got.rate >= 8 * one.rate else 'misses'})")
        server.should_exit = True


def part2() -> None:
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError:
        print("transformers is not installed: part 2 skipped")
        return
    from jaxgpt.io.hf import save_hf

    cfg = models()["6x6x384"]
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, len(CHARS), int(n)).tolist() for n in rng.integers(4, 120, 32)]
    generate_many(params, cfg, prompts, max_new_tokens=48, temperature=0.0, slots=16)  # compile what the run uses
    t = time.perf_counter()
    ours = generate_many(params, cfg, prompts, max_new_tokens=48, temperature=0.0, slots=16)
    ours_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(params, cfg, Path(tmp) / "hf")
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
    parser.add_argument("--quick", action="store_true", help="the quick start's model only; no part 2")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    part1(args)
    if not args.quick:
        part2()


if __name__ == "__main__":
    main()
