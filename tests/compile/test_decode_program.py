"""The decode programs as XLA:GPU compiles them for an H100, read on this CPU-only host: no host work per token.

jax's CUDA plugin compiles for compile-only GPUs (`jaxgpt.tools.gpus`); skipped where it is not installed. GPT-2
124M decodes in bfloat16 as `generate` runs it there, at batch 1 and 64. What is pinned:

* the loop that runs the model has a trip count XLA knows, so XLA:GPU never reads its condition back on the host
  (a while loop of unknown trip count copies its condition to the host and waits for the device every trip);
  the only condition the host reads is the outer loop's, once per `sampling.trip_tokens` tokens;
* the kernels one token launches (`hlo.loops`: fusions, GEMMs, copies, custom calls) stay at what was measured
  when this was written. With XLA's own fusion (`decode_weights.XLA_DECODE_DEFAULTS`): 171.5 at batch 1 and 134 at
  batch 64 (two tokens per trip). They were 278.5 and 218 before GPUs attended over the cache after writing the new
  key and value into it (`ops.attention.attend_written`: 206.5 and 169), read batch 1's kernels output-major
  (`decode_weights.output_major_for`: 194.5, and no product the size of a kernel written and read back per token)
  and ran each layer's cache writes and attention as one Pallas kernel (`ops.decode_attention`: 171.5 and 134).
  With the Triton fusion `generate` compiles with (`decode_weights.DECODE_OPTIONS`) batch 1 launches 79 (139
  before the Pallas kernel, 103 while it took three slices of the fused QKV projection, each a Triton fusion of its
  own: `ops.attention.attend_qkv`) and batch 64 137;
* that kernel runs once per layer and token, and writes the caches in place: no copy of a cache;
* with WHILE and CONDITIONAL among the command-buffer types (`decode_weights.DECODE_OPTIONS`) the whole
  generation, loops included, is one command buffer (a CUDA graph: one launch);
* the engine's decode chunk loops over its steps with a known trip count too, and its prefill runs the
  vocabulary's head for the prompt's last position alone and sends nothing to the host.

The command buffers are in the thunk sequence XLA dumps (`thunk_sequence_after_thunk_passes.txt`), not in the
HLO; a program compiled here has Triton GEMMs where a GPU's autotuner may pick cuBLAS (the same launch count).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

pytestmark = [pytest.mark.cuda_plugin, pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None
    or not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)),
    reason="jax's CUDA plugin is not installed (pip install 'jax[cuda13]' compiles for GPUs on CPU-only hosts)")]

from configs.gpt2_124m import get_config  # noqa: E402
from jaxgpt.generate import sampling, slots  # noqa: E402
from jaxgpt.generate.decode_weights import (  # noqa: E402
    TRIP_TOKENS,
    UNROLL,
    XLA_DECODE_DEFAULTS,
    output_major_for,
    output_major_kernels,
)
from jaxgpt.model.gpt import init_params  # noqa: E402
from jaxgpt.tools import gpus, hlo  # noqa: E402
from jaxgpt.train.config import from_config_dict  # noqa: E402

# configs/gpt2_124m.py's model as `generate(..., dtype="bfloat16")` decodes it (`decode_weights.decoding_weights`)
CFG = from_config_dict(get_config()).model.replace(dtype="bfloat16", param_dtype="bfloat16")
PROMPT, NEW_TOKENS = 16, 256
# Kernels one token launches (see the module docstring), measured on jax 0.12.0.1: with generate's options, 5 a layer
# at batch 1, where the experimental fusion of jax 0.11.2 (what GPU images ship) leaves 91; with XLA's own fusion.
KERNELS_PER_TOKEN = {1: 91 if jax.__version_info__[:2] == (0, 11) else 79, 64: 137}
XLA_KERNELS_PER_TOKEN = {1: 172, 64: 134}


def h100() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(gpus.topology_devices("h100:1"), ("data",))


def compiled(fn: object, args: tuple, options: dict | None, tmp_path: Path, **static: object) -> tuple[str, str]:
    """(HLO text, thunk sequence after XLA's thunk passes) of `fn` compiled for one H100 with abstract inputs."""
    mesh = h100()
    on_gpu = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu), args)
    dump = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_module_re": ".*"}
    with jax.set_mesh(mesh):
        text = fn.lower(*abstract, **static).compile(compiler_options={**dump, **(options or {})}).as_text()
    thunks = sorted(tmp_path.glob("*thunk_sequence_after_thunk_passes.txt"))
    return text, thunks[-1].read_text() if thunks else ""


def generate_program(batch: int, tmp_path: Path, options: dict | None = None) -> tuple[str, str]:
    """`generate`'s decode loop (`sampling._run`) for `batch` greedy rows of NEW_TOKENS tokens after PROMPT, its
    kernels stored as a GPU's `generate` stores them (output-major at batch 1: `decode_weights.output_major_for`)."""
    with jax.set_mesh(h100()):
        output_major = output_major_for(batch)
    spec = sampling.SamplerSpec(greedy=True, top_k=None, use_top_p=False, eot_token=None,
                                window_shift=sampling.default_window_shift(CFG), output_major=output_major)
    params = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    if output_major:  # in the model's bfloat16, as `generate.decode_weights.decoding_weights` prepares them for GPUs
        params = jax.eval_shape(lambda p: output_major_kernels(p, CFG), params)
    prefill = lambda p, x: sampling._prefill(p, x, jax.random.key(0), cfg=CFG, output_major=output_major,
                                             slots=sampling.cache_slots(CFG, PROMPT, NEW_TOKENS))
    with jax.set_mesh(h100()):  # the cache in the GPU's decoding dtype (a CPU's is float32: `work_dtype`)
        state = jax.eval_shape(prefill, params, jax.ShapeDtypeStruct((batch, PROMPT), jnp.int32))
    scalars = (jax.ShapeDtypeStruct((), jnp.int32), *[jax.ShapeDtypeStruct((), jnp.float32)] * 2)
    return compiled(sampling._run, (params, state, *scalars), options, tmp_path, cfg=CFG, spec=spec,
                    num_steps=NEW_TOKENS)


def attention_kernels(text: str) -> list[str]:
    """The HLO lines that call the one-kernel decode attention (`ops.decode_attention`)."""
    return [line for line in text.splitlines() if "decode_attention" in line and "custom-call(" in line]


def kernels_outside_command_buffers(thunks: str) -> list[str]:
    """The kernels of a thunk sequence that the host launches itself: those not nested in a kCommandBuffer."""
    outside, parents = [], []  # parents: (indent, is a command buffer) of the enclosing thunks
    for line in thunks.splitlines():
        m = re.match(r"^(\s*)\d+: (k\w+)\s*\[[^\]]*\]\s*(\S*)", line)
        if not m:
            continue
        indent = len(m.group(1))
        while parents and parents[-1][0] >= indent:
            parents.pop()
        if m.group(2) in ("kKernel", "kCustomKernel") and not any(cb for _, cb in parents):
            outside.append(m.group(3))
        parents.append((indent, m.group(2) == "kCommandBuffer"))
    return outside


@pytest.mark.parametrize("batch", [1, 64])
def test_generate_runs_the_model_in_a_loop_of_known_trip_count_in_one_graph(batch: int, tmp_path: Path) -> None:
    text, thunks = generate_program(batch, tmp_path)
    loops = hlo.loops(text)
    model_loops = [loop for loop in loops if loop["body_launches"] > 2 * CFG.n_layer]
    assert len(model_loops) == 1 and model_loops[0]["known"], loops
    assert model_loops[0]["trips"] * UNROLL == TRIP_TOKENS  # NEW_TOKENS in trips of TRIP_TOKENS
    per_token = model_loops[0]["body_launches"] / UNROLL
    assert per_token <= KERNELS_PER_TOKEN[batch], f"{per_token} kernels per token"
    # The only condition is the outer loop's, once per trip of trip_tokens tokens; nothing else moves. A GPU
    # evaluates it inside the graph (WHILE command buffers); the HLO still names it a host read.
    transfers = hlo.host_transfers(text)
    assert [t["kind"] for t in transfers] == ["loop condition read by the host"], transfers
    outer = [loop for loop in loops if not loop["known"]]
    assert len(outer) == 1 and outer[0]["body_launches"] < 20, outer
    top_level = [line for line in thunks.splitlines() if re.match(r"^\d+: ", line)]
    assert top_level and all("kCommandBuffer" in line or "kCopy" in line for line in top_level), top_level[:5]
    assert not kernels_outside_command_buffers(thunks)


@pytest.mark.parametrize("batch", [1, 64])
def test_xla_own_fusion_launches_what_was_measured(batch: int, tmp_path: Path) -> None:
    loops = hlo.loops(generate_program(batch, tmp_path, XLA_DECODE_DEFAULTS)[0])
    per_token = max(loop["body_launches"] for loop in loops) / UNROLL
    assert per_token <= XLA_KERNELS_PER_TOKEN[batch], f"{per_token} kernels per token"


@pytest.mark.parametrize("batch", [1, 64])
def test_each_layer_writes_its_cache_and_attends_in_one_kernel_in_place(batch: int, tmp_path: Path) -> None:
    text, _ = generate_program(batch, tmp_path)
    kernels = attention_kernels(text)
    assert len(kernels) == CFG.n_layer * UNROLL, len(kernels)
    S = sampling.cache_slots(CFG, PROMPT, NEW_TOKENS)
    cache = f"bf16[{batch},{CFG.n_head},{S},{CFG.n_embd // CFG.n_head}]"
    assert all(cache in line for line in kernels), kernels[0][:300]  # bfloat16 caches, as a GPU decodes
    copies = [line for line in text.splitlines() if re.search(rf"= {re.escape(cache)}\S* copy(-start)?\(", line)]
    assert not copies, copies[:2]


def test_engine_chunk_loops_over_its_steps_with_a_known_trip_count(tmp_path: Path) -> None:
    rows, steps = 4, 8
    params = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    state = jax.eval_shape(lambda: slots.empty_slots(CFG, rows))
    needs = slots.Needs(bias=False, noise=True, nucleus=False, scores=False)
    text, _ = compiled(slots.decode_chunk, (params, state), None, tmp_path, cfg=CFG, rows=rows, span=256, steps=steps,
                       needs=needs, banned=None, vocab_limit=None)
    loops = hlo.loops(text)
    assert [(loop["known"], loop["trips"] * UNROLL) for loop in loops] == [(True, steps)], loops
    assert not hlo.host_transfers(text)
    assert len(attention_kernels(text)) == CFG.n_layer * UNROLL  # the slots' attention: one kernel a layer, vmapped


PROMPT_P, PREFILL_ROWS = 64, 4  # the engine's prefill bucket and rows (prompts admitted together) of the test below
# top-p's sort of the vocabulary as XLA's own sort kernel: XLA:GPU sizes CUB's radix sort through the CUDA runtime
# while compiling, which a host without a GPU fails ("invalid device ordinal"); a GPU compiles it with CUB
NO_CUB_SORT = {"xla_gpu_enable_cub_radix_sort": False}


def prefill_program(score: bool, tmp_path: Path) -> str:
    """The engine's prefill of PREFILL_ROWS PROMPT_P-token prompts into 4 slots (`slots.prefill_slots`), as HLO
    text."""
    params = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    state = jax.eval_shape(lambda: slots.empty_slots(CFG, 4))
    N, V = PREFILL_ROWS, CFG.vocab_size
    setting = jax.eval_shape(lambda: slots.Setting(jax.random.split(jax.random.key(0), N), jnp.zeros(N), jnp.ones(N),
                                                   jnp.ones(N, jnp.int32), jnp.zeros((N, V)), jnp.zeros((N, V), bool)))
    rows = jax.ShapeDtypeStruct((N,), jnp.int32)
    text, _ = compiled(slots.prefill_slots, (params, state, rows, jax.ShapeDtypeStruct((N, PROMPT_P), jnp.int32),
                                             rows, setting), NO_CUB_SORT, tmp_path, cfg=CFG, score=score,
                       banned=None, vocab_limit=None)
    return text


def per_position_logits(text: str) -> list[str]:
    """The program's arrays of a vocabulary row for each prompt position (an axis of PROMPT_P or PROMPT_P - 1
    before the vocabulary's): every position's logits. The tied head's (C, V) kernel and the slots' (S, V) rows
    are not."""
    shapes = re.findall(r"\b(?:bf16|f32)\[([\d,]*)\]", text)
    return [s for s in shapes if s.endswith(f",{CFG.vocab_size}")
            and any(int(d) in (PROMPT_P - 1, PROMPT_P) for d in s.split(",")[:-1])]


def test_engine_prefill_takes_the_head_at_the_last_position_and_reads_nothing_back(tmp_path: Path) -> None:
    """Unless the prompt is scored, the vocabulary's head runs for the prompt's last position alone (no array of
    the prompt's length by the vocabulary: it was the largest product of a prefill); nothing goes to the host; the
    first pick's one conditional (greedy, sampled, sampled with top-p: `slots._start`) is the only branch, which a
    GPU runs inside its CUDA graph with CONDITIONAL command buffers (`decode_weights.WHILE_COMMAND_BUFFERS`) and
    otherwise reads once per prefill."""
    text = prefill_program(False, tmp_path / "last")
    assert not per_position_logits(text), sorted(set(per_position_logits(text)))
    assert not hlo.host_transfers(text)
    assert len(re.findall(r"\bconditional\(", text)) == 1
    scored = prefill_program(True, tmp_path / "scored")  # what the check tells apart: every position's logits
    assert per_position_logits(scored)
