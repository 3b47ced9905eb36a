"""The PyTorch baseline the issues' targets are stated against, measured in the same run as jaxgpt.

A nanoGPT-shaped model in eager PyTorch (pre-norm blocks, fused QKV, causal
`scaled_dot_product_attention`, tied embeddings, GELU MLP) with AdamW, float32 (training also under
bf16 autocast). Timing it next to jaxgpt on the same machine turns the issues' reference numbers
into ratios that a busy, shared machine cannot skew much. Optional: without torch installed the
benchmarks skip these rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

try:
    import torch
    import torch.nn.functional as F  # noqa: N812 (the PyTorch convention)
    from torch import nn
except ImportError:  # the benchmarks print "not installed" instead of a ratio
    torch = None


def available() -> bool:
    return torch is not None


def _model(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.qkv, self.out = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            self.fc, self.proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            heads = [t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, 2)]
            y = F.scaled_dot_product_attention(*heads, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(B, T, C))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return GPT()


def train_step_runner(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, batch: int,
                      autocast: bool = False) -> Callable[[], float]:
    """A function that runs one forward + backward + AdamW step and returns its seconds (two warm-up steps done).

    `autocast`: the forward pass and loss under `torch.autocast("cpu", dtype=torch.bfloat16)` (float32
    parameters and optimizer, bf16 products), PyTorch's mixed-precision recipe that jaxgpt's
    `model.dtype=bfloat16` is compared with.
    """
    model = _model(vocab, block, n_layer, n_head, n_embd)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, vocab, (batch, block)), torch.randint(0, vocab, (batch, block))

    def step() -> float:
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t

    step(), step()
    return step


def train_step_seconds(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, batch: int,
                       steps: int, autocast: bool = False) -> float:
    """Median seconds of one forward + backward + AdamW step (after two warm-up steps)."""
    step = train_step_runner(vocab, block, n_layer, n_head, n_embd, batch, autocast)
    return statistics.median(step() for _ in range(steps))


def uncached_generate_seconds(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int,
                              new_tokens: int) -> float:
    """Seconds for nanoGPT's generation loop: the whole window through the model for every token."""
    model = _model(vocab, block, n_layer, n_head, n_embd).eval()
    idx = torch.zeros((1, 1), dtype=torch.long)
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(idx[:, -block:])[:, -1]
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, -1), 1)], dim=1)
    return time.perf_counter() - t


def hf_generate_seconds(vocab: int, block: int, n_layer: int, n_head: int, n_embd: int, new_tokens: int,
                        threads: int = 2) -> float | None:
    """Seconds for Hugging Face transformers' greedy `generate` with its KV cache, 1 x `new_tokens` tokens.

    A randomly initialized GPT2LMHeadModel of the given shape, float32, `threads` torch threads; one untimed
    warm-up call, then one timed call. Its position table holds at least 1 + new_tokens positions, since
    transformers does not slide a window past `block`. None without transformers.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=max(block, new_tokens + 1), n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=0, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    prompt = torch.zeros((1, 1), dtype=torch.long)
    run = lambda: model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=0, eos_token_id=None)
    try:
        with torch.inference_mode():
            assert run().shape[1] == new_tokens + 1
            t = time.perf_counter()
            run()
            return time.perf_counter() - t
    finally:
        torch.set_num_threads(previous_threads)
