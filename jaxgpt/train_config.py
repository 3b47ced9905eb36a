"""The training configuration: an ml_collections ConfigDict with every key, and typed views of it.

Config files in `configs/` start from `base_config()` and change what they need; the command
line changes any key with `--config.key=value`. Because every key exists here, a misspelled or
unknown key is an error, and a value of the wrong type is rejected by ml_collections.
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict, config_dict

from jaxgpt.config import ModelConfig, model_config_from_dict
from jaxgpt.errors import UserError
from jaxgpt.optim import OptimConfig
from jaxgpt.presets import get_preset

# Model fields whose default is derived from others (None in ModelConfig) become typed placeholders.
_DERIVED = {"head_dim": int, "d_ff": int, "pad_id": int, "vocab_size": int}


def model_fields(cfg: ModelConfig, **changes: object) -> ConfigDict:
    """A ModelConfig (e.g. a preset) as a ConfigDict that the command line can override key by key.

    Derived sizes (head_dim, d_ff) become unset placeholders when they equal their defaults, so that
    `--config.model.n_embd=...` recomputes them; `vocab_size=None` means "the dataset's".
    """
    cfg = cfg.replace(**{k: v for k, v in changes.items() if v is not None})
    values = cfg.to_dict()
    if cfg.head_dim == cfg.n_embd // cfg.n_head:
        values["head_dim"] = None
    if cfg.d_ff == 4 * cfg.n_embd:
        values["d_ff"] = None
    values.update({k: v for k, v in changes.items() if v is None})
    out = ConfigDict()
    for name, value in values.items():
        out[name] = config_dict.placeholder(_DERIVED[name]) if value is None else value
    return out


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.workdir = ""  # where checkpoints, logs and the resolved config go (required)
    c.seed = 0  # data order, init and dropout all derive from it
    c.model = model_fields(get_preset("gpt2"), vocab_size=None)  # vocab_size None: the dataset's
    c.init_from = ""  # "", "hf:PATH" (a Hugging Face GPT-2 directory) or "workdir:PATH" (a jaxgpt run)

    c.data = ConfigDict()
    c.data.name = "stdlib_char"  # a built-in dataset, prepared into data.dir on first use ("" = custom)
    c.data.dir = "data/stdlib_char"  # a prepared dataset (python -m jaxgpt.data ...)
    c.data.bpe_file = ""  # GPT-2 ranks file for BPE datasets when offline (or env JAXGPT_BPE_FILE)

    c.batch_size = 32  # global sequences per optimizer step, summed over micro-batches and hosts
    c.grad_accum = 1  # micro-batches per step (batch_size / grad_accum sequences each)
    c.max_steps = 2000
    c.optim = ConfigDict(dataclasses.asdict(OptimConfig()))
    c.optim.decay_steps = config_dict.placeholder(int)  # None: max_steps

    c.log_interval = 10
    c.eval_interval = 250
    c.eval_batches = 20
    c.ckpt_interval = 500  # also saved after every evaluation and at the end
    c.keep_checkpoints = 2  # the last N, plus the best by validation loss
    c.resume = True  # continue from the work directory's latest checkpoint when it has one

    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # device mesh; -1 = the remaining devices
    c.cpu_devices = 0  # > 0: split each host's CPU into this many XLA devices (data parallel); 0: JAX's default

    c.distributed = ConfigDict()
    c.distributed.enabled = False  # call jax.distributed.initialize (auto-detects TPU VMs and SLURM)
    c.distributed.coordinator_address = ""  # host:port of process 0, when not auto-detected
    c.distributed.num_processes = config_dict.placeholder(int)
    c.distributed.process_id = config_dict.placeholder(int)
    c.distributed.initialization_timeout = 120  # seconds to wait for all processes
    c.distributed.heartbeat_timeout = 30  # seconds before a dead peer aborts the others

    c.sample = ConfigDict(dict(max_new_tokens=400, prompt="\n", temperature=0.8, top_k=0, top_p=1.0))
    c.compilation_cache_dir = "~/.cache/jaxgpt/xla"  # persistent XLA cache ("" disables)
    return c


def pod_config(preset: str, workdir: str, *, batch_size: int, grad_accum: int, max_steps: int, lr: float,
               min_lr: float, eval_batches: int) -> ConfigDict:
    """A large GPT on the OpenWebText-style corpus (GPT-2 BPE), laid out for pod slices.

    bf16 compute with fp32 parameters and optimizer state, XLA attention, scanned and fully rematerialized
    layers, parameters and optimizer state sharded over every chip (FSDP), the vocabulary padded to 50304
    so it splits over tensor-parallel devices. The configs/gpt2_*.py and gpt_6.7b.py files differ only in
    the arguments.
    """
    c = base_config()
    c.workdir = workdir
    c.data.name = "openwebtext"
    c.data.dir = "data/openwebtext"
    c.model = model_fields(get_preset(preset), vocab_size=50304, dtype="bfloat16", param_dtype="float32",
                           attention_impl="xla", scan_layers=True, remat="full")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.batch_size = batch_size
    c.grad_accum = grad_accum
    c.max_steps = max_steps
    c.optim.lr = lr
    c.optim.min_lr = min_lr
    c.optim.warmup_steps = 2000
    c.optim.weight_decay = 0.1
    c.optim.b2 = 0.95
    c.eval_interval = 1000
    c.eval_batches = eval_batches
    c.ckpt_interval = 1000
    c.log_interval = 10
    return c


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The validated, typed view of a ConfigDict: what the trainer actually reads."""

    workdir: str
    seed: int
    model: ModelConfig
    optim: OptimConfig
    batch_size: int
    grad_accum: int
    max_steps: int
    log_interval: int
    eval_interval: int
    eval_batches: int
    ckpt_interval: int
    keep_checkpoints: int
    resume: bool
    mesh: tuple[int, int, int]
    raw: ConfigDict = dataclasses.field(repr=False, compare=False)


def resolve(c: ConfigDict, vocab_size: int) -> TrainConfig:
    """Check the ConfigDict and build typed configs; `vocab_size` is the dataset's."""
    if not c.workdir:
        raise UserError("config.workdir is empty: pass --config.workdir=DIR (where checkpoints and logs go)")
    for key in ("batch_size", "grad_accum", "max_steps", "log_interval", "eval_interval", "eval_batches",
                "ckpt_interval", "keep_checkpoints"):
        if c[key] < 1:
            raise UserError(f"config.{key}={c[key]} must be >= 1")
    if c.batch_size % c.grad_accum:
        raise UserError(f"config.batch_size={c.batch_size} is not divisible by config.grad_accum={c.grad_accum}")
    model = dict(c.model.to_dict())
    if model["vocab_size"] is None:
        model["vocab_size"] = vocab_size
    elif model["vocab_size"] < vocab_size:
        raise UserError(f"config.model.vocab_size={model['vocab_size']} is smaller than the dataset's vocabulary "
                        f"({vocab_size}): raise it or leave it unset")
    optim = dict(c.optim.to_dict())
    if optim["decay_steps"] is None:
        optim["decay_steps"] = max(c.max_steps, optim["warmup_steps"] + 1)
    try:
        optim_cfg = OptimConfig(**optim)
    except TypeError as e:
        raise UserError(f"bad optimizer config: {e}") from None
    return TrainConfig(
        workdir=c.workdir, seed=c.seed, model=model_config_from_dict(model), optim=optim_cfg,
        batch_size=c.batch_size, grad_accum=c.grad_accum, max_steps=c.max_steps, log_interval=c.log_interval,
        eval_interval=c.eval_interval, eval_batches=c.eval_batches, ckpt_interval=c.ckpt_interval,
        keep_checkpoints=c.keep_checkpoints, resume=c.resume, mesh=(c.mesh.data, c.mesh.fsdp, c.mesh.tensor), raw=c)
