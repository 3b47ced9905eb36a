"""Serving speed on this machine, measured in one run: `jaxgpt serve`'s app under concurrent streaming clients,
against `generate` alone on the same model, and a batch of ragged prompts through the engine vs transformers'
padded `generate`.

    python benchmarks/bench_serve.py                 # both models, 1 / 4 / 16 clients
    python benchmarks/bench_serve.py --requests 2    # fewer requests per client (quicker)
    python benchmarks/bench_serve.py --quick         # the quick start's model only, no transformers part
    python benchmarks/bench_serve.py --api_servers 2 # two HTTP front ends
    python benchmarks/bench_serve.py --adapters 4    # only part 3: 16 clients over 4 LoRA adapters vs the merged base

Part 1: `jaxgpt serve`'s processes (16 slots): the engine's side (`jaxgpt.serve.core`) in this process and
--api_servers HTTP front ends (`jaxgpt.serve.launch`) on 127.0.0.1, with random weights of the quick start's model
(configs/stdlib_char.py: 4 layers x 4 heads x 128 wide, 256 characters of context) and of the 6 x 6 x 384 one,
driven by N client threads of the official `openai` client, CLIENTS_PER_PROCESS to a process of their own, each
streaming --requests completions (prompts of 8-64 random characters, sent as token ids; 64 new tokens,
temperature 1, stream_options.include_usage with vLLM's continuous_usage_stats, which says how many tokens each
chunk holds) one after another. First, `generate` alone (`jaxgpt.generate.sampling.generate`, what `sample.py`
runs) on such prompts one after another: its tokens/s, prefill included, is what one client could get with no
server at all. Then the engine alone (its loop in this process, no HTTP) on the same kind of requests, N at once
for each N: the most the server can give N clients on this machine, so the clients' ratios to it show what HTTP
costs. Printed per N: aggregate completion tokens/s over the wall time, that over the engine alone's with N,
over one client's and over `generate` alone's, the p50 / p99 of time to first token (request sent to the first
chunk with tokens) and of inter-token latency (between the chunks of one stream, divided by the tokens each
brought), and the CPU time per token of the engine's process, the front ends and the clients (on a CPU the
engine's includes the model's compute). Targets (issue 49, an accelerator's): one client >= 0.8x `generate`
alone; the most clients >= 0.8x the engine alone with as many at once and >= 15x one client; their TTFT p99 <=
250 ms. benchmarks/device_check.py runs this part (`measure`) on an accelerator with GPT-2 124M's shapes and 1,
16 and 64 clients.
Part 2: 32 ragged prompts, 48 greedy new tokens each, through `many.generate_many` (what `sample.py
--prompt_file` runs) with 16 slots, and through transformers' `generate` on the same weights exported with
`save_hf`, left-padded in batches of 16 with an attention mask; tokens/s of each and how many rows agree.
Part 3 (--adapters N, alone): the 6 x 6 x 384 model served with N LoRA adapters (`jaxgpt serve --adapter`: ranks
4, 8, 12, 16, ... on every linear layer, random nonzero B), 16 streaming clients spread over them (client c names
adapter c mod N), against 16 clients of the same workload on the base with one adapter merged in, served without
adapters: the tokens/s ratio is what decoding rows of several adapters in one batch costs (issue 63's target:
>= 0.8x). Both servers run at once and --rounds measurements alternate between them, so that a load on the machine
that changes during the run weighs on both alike (measured one after the other on the shared 2-core machine, the
merged base alone got 626 tokens/s in one run and 450 in another). Before that, the same kind of requests go
through each engine alone (no HTTP, 16 at once), alternated likewise: that ratio is the model's own cost, apart
from the HTTP side both share.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import openai  # noqa: E402

from jaxgpt.data.tokenizer import CharTokenizer, Tokenizer  # noqa: E402
from jaxgpt.generate.engine import Engine, Request  # noqa: E402
from jaxgpt.generate.many import generate_many  # noqa: E402
from jaxgpt.generate.sampling import generate  # noqa: E402
from jaxgpt.generate.slots import Needs  # noqa: E402
from jaxgpt.model.config import ModelConfig  # noqa: E402
from jaxgpt.model.gpt import init_params  # noqa: E402
from jaxgpt.ops.platform import keep_freed_memory  # noqa: E402
from jaxgpt.serve.app import Served  # noqa: E402
from jaxgpt.serve.core import Core  # noqa: E402
from jaxgpt.serve.launch import FrontEnds, listen  # noqa: E402

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # a sorted character vocabulary of 96
SAMPLED = Needs(bias=False, noise=True, nucleus=False, scores=False)  # what every request here asks for
# One process of openai clients spends about 60 us of CPU per streamed token (2-core CPU, 16 clients): in one
# process they alone would cap a GPU's load near 16k tokens/s, so they are spread.
CLIENTS_PER_PROCESS = 16


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests of one measurement: prompts of token ids (lengths in `lengths`, ids below `vocab`), each
    sampled at temperature 1 for `new_tokens` tokens, `requests` one after another per client."""

    lengths: tuple[int, int] = (8, 64)  # the shortest and longest prompt
    vocab: int = len(CHARS)
    new_tokens: int = 64
    clients: tuple[int, ...] = (1, 4, 16)
    requests: int = 4

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, self.vocab, int(k)).tolist()
                for k in rng.integers(self.lengths[0], self.lengths[1] + 1, n)]


def models() -> dict[str, ModelConfig]:
    from configs.stdlib_char import get_config  # the quick start's model

    quick = get_config().model
    return {"quick start " + f"{quick.n_layer}x{quick.n_head}x{quick.n_embd}":
            ModelConfig(vocab_size=len(CHARS), block_size=quick.block_size, n_layer=quick.n_layer,
                        n_head=quick.n_head, n_embd=quick.n_embd),
            "6x6x384": ModelConfig(vocab_size=len(CHARS), block_size=256, n_layer=6, n_head=6, n_embd=384)}


@contextlib.contextmanager
def serving(engine: Engine, cfg: ModelConfig, tokenizer: Tokenizer, api_servers: int
            ) -> Iterator[tuple[int, list[int]]]:
    """`jaxgpt serve`'s processes around `engine`: its side in a thread of this process, `api_servers` front ends
    on a free port of 127.0.0.1; (the port, the front ends' process ids). The engine's adapters are served too."""
    adapters = tuple((name, name) for name in engine.adapters.names) if engine.adapters else ()
    with listen("127.0.0.1", 0) as sock:
        front_ends = FrontEnds(Served(tokenizer, "m", cfg, engine.n_slots, adapters=adapters), None, sock)
        conns = front_ends.start(api_servers)
        core = threading.Thread(target=Core(engine, conns, replace=front_ends.replace).run, daemon=True)
        core.start()
        try:
            yield sock.getsockname()[1], [p.pid for p in front_ends.procs.values()]
        finally:
            front_ends.stop()  # SIGTERM: each finishes its streams, closes its end, and the core returns
            core.join()
            front_ends.join()


def engine_alone(engine: Engine, prompts: list[list[int]], at_once: int, new_tokens: int,
                 adapters: tuple[str | None, ...] = (None,)) -> float:
    """Tokens/s of the engine itself (no HTTP, its loop in this thread) on `prompts`, `at_once` decoding together:
    what the server could give that many clients at most. Request i decodes with `adapters[i % len(adapters)]`."""
    t = time.perf_counter()
    for start in range(0, len(prompts), at_once):
        for i, p in enumerate(prompts[start:start + at_once], start):
            engine.submit(Request(p, new_tokens, emit=lambda *_: None, done=lambda _: None, temperature=1.0, seed=i,
                                  logprobs=False, adapter=adapters[i % len(adapters)]))
        if at_once == 1:  # one client: the next request once this one has ended
            engine.drain()
    engine.drain()  # many: the queue refills each slot as it frees, as clients that send again at once would
    return new_tokens * len(prompts) / (time.perf_counter() - t)


class Load:
    """What `clients` threads streaming `requests` completions each measured, and the CPU seconds per token of
    the engine's process, the front ends and the clients."""

    def __init__(self, tokens: int, wall: float, first: list[float], gaps: list[float], cpu: dict[str, float]
                 ) -> None:
        self.rate = tokens / wall
        self.first_p50, self.first_p99 = np.percentile(first, [50, 99])
        self.gap_p50, self.gap_p99 = np.percentile(gaps, [50, 99]) if gaps else (float("nan"), float("nan"))
        self.cpu_per_token = {who: seconds / tokens for who, seconds in cpu.items()}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has used (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(port: int, front_ends: list[int], clients: int, prompts: list[list[int]], new_tokens: int,
         models: tuple[str, ...] = ("m",)) -> Load:
    """Stream a completion of each of `prompts` (seed: its index), `clients` threads sending theirs one after
    another, CLIENTS_PER_PROCESS threads to a process (as clients are apart from the server; their parsing then
    holds no lock of the server's), timed from when every process is ready. Client c asks for model
    `models[c % len(models)]`."""
    spawn = multiprocessing.get_context("spawn")
    per_client = len(prompts) // clients
    shares = [list(range(c, min(c + CLIENTS_PER_PROCESS, clients))) for c in range(0, clients, CLIENTS_PER_PROCESS)]
    ready, results = spawn.Barrier(len(shares) + 1), spawn.Queue()
    procs = [spawn.Process(target=client_process, args=(port, [(c, prompts[c * per_client:(c + 1) * per_client])
                                                               for c in share], per_client, new_tokens, ready,
                                                        results, models)) for share in shares]
    for p in procs:
        p.start()
    ready.wait()
    t0, cpu0 = time.perf_counter(), [time.process_time(), *map(cpu_seconds, front_ends)]
    gathered = [results.get() for _ in procs]
    wall = time.perf_counter() - t0
    cpu1 = [time.process_time(), *map(cpu_seconds, front_ends)]
    for p in procs:
        p.join()
    rows = [r for rows, _ in gathered for r in rows]
    cpu = {"engine process": cpu1[0] - cpu0[0], "front ends": sum(cpu1[1:]) - sum(cpu0[1:]),
           "clients": sum(seconds for _, seconds in gathered)}
    return Load(sum(t for t, _, _ in rows), wall, [f for _, f, _ in rows], [g for *_, gs in rows for g in gs], cpu)


def client_process(port: int, work: list[tuple[int, list[list[int]]]], per_client: int, new_tokens: int,
                   ready: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue,
                   models: tuple[str, ...]) -> None:
    """Some of `load`'s clients: a thread for each (client c, its prompts), once all processes are ready; puts
    ((completion tokens, time to first token, inter-token latencies) of every request, CPU seconds used)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

    def one_request(i: int, prompt: list[int]) -> tuple[int, float, list[float]]:
        sent = time.perf_counter()
        last, first, gaps, tokens = None, 0.0, [], 0
        for chunk in client.completions.create(  # request i is client i // per_client's
                model=models[i // per_client % len(models)], prompt=prompt, max_tokens=new_tokens, temperature=1.0,
                seed=i, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True}):
            now = time.perf_counter()
            brought, tokens = chunk.usage.completion_tokens - tokens, chunk.usage.completion_tokens
            if not chunk.choices or not brought:  # the usage's own chunk; a finish without new tokens
                continue
            if last is None:
                first = now - sent
            else:  # a chunk brings the tokens of one read of the device (8 per chunk decoded)
                gaps += [(now - last) / brought] * brought
            last = now
        return tokens, first, gaps

    def one_client(c: int, mine: list[list[int]]) -> list[tuple[int, float, list[float]]]:
        return [one_request(c * per_client + i, p) for i, p in enumerate(mine)]

    client.completions.create(model="m", prompt=work[0][1][0], max_tokens=1)  # untimed: the client's lazy imports
    ready.wait()
    cpu = time.process_time()
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        rows = [r for rows in pool.map(lambda w: one_client(*w), work) for r in rows]
    results.put((rows, time.process_time() - cpu))


def alone(cfg: ModelConfig, params: dict, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of `generate` alone on `prompts`, one after another (compiled first): what one client could get
    with no server at all."""
    run = lambda i, p: generate(params, cfg, p, max_new_tokens=new_tokens, key=i, temperature=1.0)
    for i, p in enumerate(prompts):  # one compile per prompt length
        run(i, p)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        run(i, p)
    return new_tokens * len(prompts) / (time.perf_counter() - t)


def measure(name: str, cfg: ModelConfig, params: dict, tokenizer: Tokenizer, work: Workload, slots: int,
            api_servers: int = 1) -> dict[str, float]:
    """Part 1 for one model, printed as it goes; every number, by name (benchmarks/device_check.py's serve part
    records them)."""
    engine = Engine(params, cfg, slots=slots, max_waiting=max(work.clients) * work.requests,
                    vocab_limit=tokenizer.vocab_size)
    # every row count's and span's chunk, and every prompt bucket, of the requests `load` sends
    got = {"warm_up_s": engine.warm_up([SAMPLED], range(work.lengths[0], work.lengths[1] + 1), work.new_tokens)}
    base = got["generate_tokens_per_s"] = alone(cfg, params, work.prompts(16, seed=1), work.new_tokens)
    print(f"{name}: generate alone {base:,.0f} tokens/s (batch 1, {work.new_tokens} new tokens, prefill included)",
          flush=True)
    for n in work.clients:
        got[f"engine{n}_tokens_per_s"] = engine_alone(engine, work.prompts(n * work.requests, n), n,
                                                      work.new_tokens)
    print(f"{name}: the engine alone (no HTTP) with " + ", ".join(
        f"{n} at once {got[f'engine{n}_tokens_per_s']:,.0f} tokens/s" for n in work.clients)
        + ": the most the server can give as many clients here", flush=True)
    print(f"{'clients':>8}{'tokens/s':>11}{'x engine':>10}{'x 1 client':>12}{'x generate':>12}{'TTFT p50':>10}"
          f"{'p99 s':>8}{'ITL p50':>10}{'p99 ms':>8}   CPU us per token: engine / front ends / clients", flush=True)
    with serving(engine, cfg, tokenizer, api_servers) as (port, front_ends):
        for clients in work.clients:
            one = load(port, front_ends, clients, work.prompts(clients * work.requests, clients), work.new_tokens)
            got.update({f"clients{clients}_tokens_per_s": one.rate, f"clients{clients}_ttft_p50_s": one.first_p50,
                        f"clients{clients}_ttft_p99_s": one.first_p99, f"clients{clients}_itl_p50_s": one.gap_p50,
                        f"clients{clients}_itl_p99_s": one.gap_p99})
            got.update({f"clients{clients}_cpu_us_per_token_{who.replace(' ', '_')}": seconds * 1e6
                        for who, seconds in one.cpu_per_token.items()})
            ratio = one.rate / got[f"clients{min(work.clients)}_tokens_per_s"]
            cpu = " / ".join(f"{seconds * 1e6:.0f}" for seconds in one.cpu_per_token.values())
            print(f"{clients:>8}{one.rate:>11,.0f}{one.rate / got[f'engine{clients}_tokens_per_s']:>9.2f}x"
                  f"{ratio:>11.2f}x{one.rate / base:>11.2f}x{one.first_p50:>10.3f}{one.first_p99:>8.3f}"
                  f"{one.gap_p50 * 1e3:>10.2f}{one.gap_p99 * 1e3:>8.2f}   {cpu}", flush=True)
    for line in targets(got):
        print(f"{name}: {line}")
    return got


def targets(got: dict[str, float]) -> list[str]:
    """Issue 49's targets for the loads measured: one client >= 0.8x `generate` alone; the most clients >= 0.8x
    the engine alone with as many at once and >= 15x one client, their time to first token p99 <= 250 ms."""
    loads = sorted(int(k[len("clients"):-len("_tokens_per_s")]) for k in got
                   if k.startswith("clients") and k.endswith("_tokens_per_s"))
    if not loads:
        return []
    low, high = loads[0], loads[-1]
    rate = lambda n: got[f"clients{n}_tokens_per_s"]
    lines = [f"{low} client {rate(low) / got['generate_tokens_per_s']:.2f}x generate alone (target >= 0.8x)"]
    if high > low:
        lines += [f"{high} clients {rate(high) / got[f'engine{high}_tokens_per_s']:.2f}x the engine alone with "
                  f"{high} at once (target >= 0.8x)",
                  f"{high} clients {rate(high) / rate(low):.2f}x {low} client (target >= 15x)",
                  f"{high} clients TTFT p99 {got[f'clients{high}_ttft_p99_s'] * 1e3:.0f} ms (target <= 250 ms)"]
    return lines


def part1(args: argparse.Namespace) -> None:
    keep_freed_memory()  # as `jaxgpt serve` does
    for name, cfg in list(models().items())[:1 if args.quick else None]:
        measure(name, cfg, init_params(cfg, jax.random.key(0)), CharTokenizer(CHARS),
                Workload(requests=args.requests), slots=16, api_servers=args.api_servers)


def part3(n: int, api_servers: int, rounds: int) -> None:
    """16 clients over `n` adapters against 16 on the merged base alone (the module docstring's part 3)."""
    from jaxgpt.generate.adapters import Adapter, stack
    from jaxgpt.model import lora
    from jaxgpt.model.gpt import abstract_variables

    keep_freed_memory()
    cfg, work = models()["6x6x384"], Workload(clients=(16,), requests=2)
    params, tokenizer = init_params(cfg, jax.random.key(0)), CharTokenizer(CHARS)
    adapters = []
    for i in range(n):
        found = lora.sites(abstract_variables(cfg)["params"], (), 4 * (i + 1))
        tree = jax.tree.map(np.asarray, nn.unbox(lora.init_adapters(found, jax.random.key(i))))
        tree = jax.tree_util.tree_map_with_path(lambda path, x, i=i: np.random.default_rng(i).normal(
            0, 0.02, x.shape).astype(np.float32) if path[-1].key == "lora_b" else x, tree)
        adapters.append(Adapter(f"adapter{i}", tree, 2.0))
    names = tuple(a.name for a in adapters)
    setups = {"merged base": (lora.merge(params, adapters[0].tree, 2.0), None, ("m",), (None,)),
              f"{n} adapters": (params, stack(adapters, cfg), names, names)}
    engines = {}
    for what, (weights, served, *_) in setups.items():
        engines[what] = Engine(weights, cfg, slots=16, max_waiting=64, vocab_limit=tokenizer.vocab_size,
                               adapters=served)
        engines[what].warm_up([SAMPLED], range(work.lengths[0], work.lengths[1] + 1), work.new_tokens)
    # Rounds alternate between the two, so that a load on the machine that changes during the run weighs on both.
    alone_rates: dict[str, list[float]] = {what: [] for what in setups}
    rates: dict[str, list[float]] = {what: [] for what in setups}
    for r in range(rounds):
        for what, engine in engines.items():
            alone_rates[what].append(engine_alone(engine, work.prompts(16 * work.requests, r), 16, work.new_tokens,
                                                  setups[what][3]))
    with contextlib.ExitStack() as servers:
        ports = {what: servers.enter_context(serving(engine, cfg, tokenizer, api_servers))
                 for what, engine in engines.items()}
        for r in range(rounds):
            for what, (port, front_ends) in ports.items():
                rates[what].append(load(port, front_ends, 16, work.prompts(16 * work.requests, 16 + r),
                                        work.new_tokens, setups[what][2]).rate)
    for what in setups:
        print(f"6x6x384, 16 clients on the {what}: " + ", ".join(f"{x:,.0f}" for x in rates[what])
              + " tokens/s (the engine alone, 16 at once: " + ", ".join(f"{x:,.0f}" for x in alone_rates[what])
              + ")")
    ratio = lambda got: np.array(got[f"{n} adapters"]) / np.array(got["merged base"])
    print(f"16 clients over {n} adapters (ranks 4-{4 * n}, every linear layer) / 16 on the merged base, round by "
          f"round: {', '.join(f'{x:.2f}' for x in ratio(rates))}, median {np.median(ratio(rates)):.2f}x (target "
          f">= 0.8x); the engine alone: {', '.join(f'{x:.2f}' for x in ratio(alone_rates))}, median "
          f"{np.median(ratio(alone_rates)):.2f}x")


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
    parser.add_argument("--api_servers", type=int, default=1, help="HTTP front-end processes (jaxgpt serve's)")
    parser.add_argument("--adapters", type=int, default=0, help="only part 3, with this many LoRA adapters")
    parser.add_argument("--rounds", type=int, default=3, help="part 3: alternated measurements of each server")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    if args.adapters:
        part3(args.adapters, args.api_servers, args.rounds)
        return
    part1(args)
    if not args.quick:
        part2()


if __name__ == "__main__":
    main()
