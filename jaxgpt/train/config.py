"""The run configuration: the ConfigDict every config file starts from, and the typed configs it becomes.

Config files in `configs/` start from `base_config()` and change what they need; the command line changes
any key with `--config.key=value`. Every key exists here, so a misspelled key is an error and a value of
the wrong type is rejected by ml_collections. The commands turn the ConfigDict into a `TrainConfig` once
(`from_config_dict`); the library reads only typed configs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ml_collections import ConfigDict, config_dict

from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig, model_config_from_dict
from jaxgpt.model.presets import get_preset
from jaxgpt.train.optim import OptimConfig

TASKS = ("lm", "classify", "seq2seq")
# Model fields whose default is derived from others (None in ModelConfig) become typed placeholders.
_UNSET_TYPES = {"head_dim": int, "d_ff": int, "pad_id": int, "vocab_size": int}


def model_fields(cfg: ModelConfig, **changes: object) -> ConfigDict:
    """A ModelConfig (e.g. a preset) as a ConfigDict that the command line can override key by key.

    Derived sizes (head_dim, d_ff) stay unset when they follow the rule, so that `--config.model.n_embd=...`
    recomputes them; `vocab_size=None` means "the dataset's".
    """
    values = {**cfg.replace(**{k: v for k, v in changes.items() if v is not None}).settings(),
              **{k: v for k, v in changes.items() if v is None}}
    return ConfigDict({name: config_dict.placeholder(_UNSET_TYPES[name]) if value is None else value
                       for name, value in values.items()})


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.task = "lm"  # "lm": language modelling on a token dataset; "classify": seed 001's fine-tuning (c.classify);
    # "seq2seq": the encoder-decoder on source/target pairs (c.seq2seq; model.n_layer is the decoder's layers)
    c.workdir = ""  # where checkpoints, logs and the resolved config go (required)
    c.seed = 0  # data order, init and dropout all derive from it
    c.model = model_fields(get_preset("gpt2"), vocab_size=None)  # vocab_size None: the dataset's
    c.init_from = ""  # "", "hf:PATH" (a Hugging Face GPT-2 directory) or "workdir:PATH" (a jaxgpt run)

    c.data = ConfigDict()
    c.data.name = "stdlib_char"  # a built-in dataset, prepared into data.dir on first use ("" = custom)
    c.data.dir = "data/stdlib_char"  # a prepared dataset (jaxgpt data ...)
    c.data.bpe_file = ""  # GPT-2 ranks file for BPE tokenizers when offline (or env JAXGPT_BPE_FILE)
    c.data.csv = ""  # wine_reviews: Kaggle's winemag-data-130k-v2.csv (a login is needed to download it)

    c.classify = ConfigDict()  # task "classify": the model, tokenizer and body weights come from init_from
    c.classify.data = "stdlib_packages"  # a built-in task name, or a .csv / .jsonl file of (text, label)
    c.classify.val_fraction = 0.2  # held out for accuracy (stratified by class)
    c.classify.max_len = config_dict.placeholder(int)  # tokens per row incl. the classification token
    c.classify.cls_token = ""  # "" = end-of-text for BPE models, "\n" for char models
    c.classify.lm_weight = 0.5  # weight of the auxiliary language-model loss (GPT-1: 0.5)
    c.classify.cls_dropout = 0.1  # dropout on the hidden state before the classification head

    c.seq2seq = ConfigDict()  # task "seq2seq": jaxgpt/tasks/seq2seq.py
    c.seq2seq.data = "copy"  # built-in "copy", "reverse", "stdlib_identifiers", or a .tsv/.txt/.jsonl file of pairs
    c.seq2seq.val_fraction = 0.05  # pairs held out (by a hash of the source) for loss, accuracy and exact match
    c.seq2seq.tokenizer = "char"  # one text tokenizer for sources and targets: "char" or "word"
    c.seq2seq.word_vocab = 10000  # tokenizer "word": vocabulary size incl. [PAD] and [UNK]
    c.seq2seq.examples = 20000  # "copy" / "reverse": random strings generated (train + held-out)
    c.seq2seq.symbols = 10  # "copy" / "reverse": alphabet size
    c.seq2seq.length = 10  # "copy" / "reverse": longest string (lengths are uniform in [1, length])
    c.seq2seq.n_encoder_layer = 2
    c.seq2seq.share_embeddings = True  # one token table for sources and targets (they share the tokenizer)

    c.label_smoothing = 0.0  # lm and seq2seq: targets smoothed toward uniform (optax.smooth_labels; 0.1 in the paper)
    c.loss_chunk = 0  # language modelling: positions per chunk of the cross-entropy (0: all logits at once)
    c.batch_size = 32  # global sequences per optimizer step, summed over micro-batches and hosts
    c.grad_accum = 1  # micro-batches per step (batch_size / grad_accum sequences each)
    c.max_steps = 2000
    c.optim = ConfigDict(dataclasses.asdict(OptimConfig()))
    c.optim.decay_steps = config_dict.placeholder(int)  # None: max_steps

    c.log_interval = 10
    c.eval_interval = 250
    c.eval_batches = 20  # language modelling: batches per evaluation (classification uses all held-out rows)
    c.ckpt_interval = 500  # also saved after every evaluation and at the end
    c.keep_checkpoints = 2  # the last N, plus the best by validation loss
    c.resume = True  # continue from the work directory's latest checkpoint when it has one
    c.resume_changes = False  # resume even though settings that change the run's trajectory differ
    c.resume_fallback = False  # resume from the newest readable checkpoint when the latest cannot be read

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
    c.wandb = ConfigDict(dict(project="", name=""))  # a project name logs to Weights & Biases (pip install wandb)
    return c


def pod_config(preset: str, workdir: str, *, batch_size: int, grad_accum: int, max_steps: int, lr: float,
               min_lr: float, eval_batches: int) -> ConfigDict:
    """A large GPT on the OpenWebText-style corpus (GPT-2 BPE), laid out for pod slices.

    bf16 compute with fp32 parameters and optimizer state, the platform's fused attention (splash on TPU,
    cuDNN on GPU), a chunked loss (never all float32 logits at once), scanned and fully rematerialized
    layers, parameters and optimizer state sharded over every chip (FSDP), the vocabulary padded to 50304
    so it splits over tensor-parallel devices. The configs/gpt2_*.py and gpt_6.7b.py files differ only in
    the arguments.
    """
    c = base_config()
    c.workdir = workdir
    c.data.name = "openwebtext"
    c.data.dir = "data/openwebtext"
    c.model = model_fields(get_preset(preset), vocab_size=50304, dtype="bfloat16", param_dtype="float32",
                           attention_impl="auto", scan_layers=True, remat="full")
    c.loss_chunk = 128
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
class DataConfig:
    name: str  # a built-in dataset prepared into `dir` on first use, or "" for a dataset prepared by hand
    dir: str
    bpe_file: str
    csv: str = ""  # wine_reviews: the path of Kaggle's CSV


@dataclasses.dataclass(frozen=True)
class ClassifyConfig:
    data: str
    val_fraction: float
    max_len: int | None
    cls_token: str
    lm_weight: float
    cls_dropout: float


@dataclasses.dataclass(frozen=True)
class Seq2SeqTaskConfig:
    data: str
    val_fraction: float
    tokenizer: str
    word_vocab: int
    examples: int
    symbols: int
    length: int
    n_encoder_layer: int
    share_embeddings: bool


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    enabled: bool
    coordinator_address: str
    num_processes: int | None
    process_id: int | None
    initialization_timeout: int
    heartbeat_timeout: int


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """What the process sets up before any computation: devices, hosts, the compile cache."""

    mesh: tuple[int, int, int]  # (data, fsdp, tensor); one -1 = the remaining devices
    cpu_devices: int
    compilation_cache_dir: str
    distributed: DistributedConfig


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int
    prompt: str
    temperature: float
    top_k: int
    top_p: float


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run, validated and typed: what the loop and the tasks read."""

    task: str
    workdir: str
    seed: int
    model: ModelConfig  # language modelling: with `vocab_from_data`, its vocab_size is replaced by the dataset's
    vocab_from_data: bool
    init_from: str
    optim: OptimConfig
    data: DataConfig
    classify: ClassifyConfig
    seq2seq: Seq2SeqTaskConfig
    runtime: RuntimeConfig
    sample: SampleConfig
    batch_size: int
    grad_accum: int
    max_steps: int
    log_interval: int
    eval_interval: int
    eval_batches: int
    ckpt_interval: int
    keep_checkpoints: int
    resume: bool
    settings: dict[str, Any] = dataclasses.field(repr=False, compare=False)  # the ConfigDict as JSON
    resume_changes: bool = False  # resume although trajectory settings changed
    resume_fallback: bool = False  # resume from the newest readable checkpoint
    wandb_project: str = ""  # non-empty: also log to Weights & Biases
    wandb_name: str = ""
    loss_chunk: int = 0  # language modelling: positions per cross-entropy chunk (0: dense)
    label_smoothing: float = 0.0  # weight of the uniform distribution in the targets (lm, seq2seq)

    def with_model(self, model: ModelConfig) -> TrainConfig:
        return dataclasses.replace(self, model=model, vocab_from_data=False)


def _typed(cls: type, values: dict[str, Any], where: str) -> Any:
    try:
        return cls(**values)
    except TypeError as e:
        raise UserError(f"bad {where} config: {e}") from None


# The closing sample's length: its tokens are int32 positions and a (1, n) buffer; beyond this it is a typo.
MAX_NEW_TOKENS = 1 << 20


def non_finite(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of every NaN or infinite float in a nested dict (they would surface only as a NaN loss)."""
    bad = []
    for key, value in values.items():
        if isinstance(value, dict):
            bad += non_finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{prefix}{key}={value}")
    return bad


def _check_numbers(c: ConfigDict) -> None:
    """Range checks that OptimConfig and ModelConfig do not make, done before anything is compiled."""
    if bad := non_finite(c.to_dict()):
        raise UserError(f"config values must be finite numbers: {', '.join(bad)}")
    if c.optim.eps <= 0:
        raise UserError(f"config.optim.eps={c.optim.eps} must be > 0 (e.g. 1e-8): it keeps Adam's division finite")
    if not 0 <= c.seed < 2**63:
        raise UserError(f"config.seed={c.seed} must be in [0, 2**63)")
    s = c.sample
    if not 0 <= s.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"config.sample.max_new_tokens={s.max_new_tokens} must be in [0, {MAX_NEW_TOKENS}]")
    if s.temperature < 0 or s.top_k < 0 or not 0 < s.top_p <= 1:
        raise UserError(f"config.sample: temperature={s.temperature} and top_k={s.top_k} must be >= 0, "
                        f"top_p={s.top_p} in (0, 1]")


def from_config_dict(c: ConfigDict) -> TrainConfig:
    """Check a ConfigDict (a config file plus command-line overrides) and build the typed config."""
    _check_numbers(c)
    if c.task not in TASKS:
        raise UserError(f"config.task={c.task!r} is unknown: choose one of {TASKS}")
    if not c.workdir:
        raise UserError("config.workdir is empty: pass --config.workdir=DIR (where checkpoints and logs go)")
    for key in ("batch_size", "grad_accum", "max_steps", "log_interval", "eval_interval", "eval_batches",
                "ckpt_interval", "keep_checkpoints"):
        if c[key] < 1:
            raise UserError(f"config.{key}={c[key]} must be >= 1")
    if c.batch_size % c.grad_accum:
        raise UserError(f"config.batch_size={c.batch_size} is not divisible by config.grad_accum={c.grad_accum}")
    if c.loss_chunk < 0:
        raise UserError(f"config.loss_chunk={c.loss_chunk} must be >= 0 (0 computes all logits at once)")
    if c.cpu_devices < 0:
        raise UserError(f"config.cpu_devices={c.cpu_devices} must be >= 0 (0 keeps JAX's default of one CPU device)")
    k = c.classify
    if not 0.0 < k.val_fraction < 1.0:
        raise UserError(f"config.classify.val_fraction={k.val_fraction} must be between 0 and 1 (exclusive), "
                        "e.g. 0.2")
    if k.lm_weight < 0:
        raise UserError(f"config.classify.lm_weight={k.lm_weight} must be >= 0")
    if not 0.0 <= k.cls_dropout < 1.0:
        raise UserError(f"config.classify.cls_dropout={k.cls_dropout} must be in [0, 1)")
    if k.max_len is not None and k.max_len < 2:
        raise UserError(f"config.classify.max_len={k.max_len} must be >= 2 (a text token and the class token)")
    if not 0.0 <= c.label_smoothing < 1.0:
        raise UserError(f"config.label_smoothing={c.label_smoothing} must be in [0, 1) (the paper's is 0.1)")
    if c.label_smoothing and c.task == "classify":
        raise UserError("config.label_smoothing applies to tasks lm and seq2seq: set it to 0 for classify")
    if c.label_smoothing and c.loss_chunk:
        raise UserError("config.label_smoothing needs the dense loss: set config.loss_chunk=0")
    s = c.seq2seq
    if not 0.0 < s.val_fraction < 1.0:
        raise UserError(f"config.seq2seq.val_fraction={s.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05")
    for key in ("word_vocab", "examples", "symbols", "length", "n_encoder_layer"):
        if s[key] < 1:
            raise UserError(f"config.seq2seq.{key}={s[key]} must be >= 1")
    model = dict(c.model.to_dict())
    vocab_from_data = model["vocab_size"] is None
    if vocab_from_data:
        model["vocab_size"] = 1  # replaced by the dataset's vocabulary before anything is built
    optim = dict(c.optim.to_dict())
    if optim["decay_steps"] is None:
        optim["decay_steps"] = max(c.max_steps, optim["warmup_steps"] + 1)
    return TrainConfig(
        task=c.task, workdir=c.workdir, seed=c.seed, model=model_config_from_dict(model),
        vocab_from_data=vocab_from_data, init_from=c.init_from, optim=_typed(OptimConfig, optim, "optimizer"),
        data=DataConfig(**c.data.to_dict()), classify=ClassifyConfig(**k.to_dict()),
        seq2seq=Seq2SeqTaskConfig(**s.to_dict()), label_smoothing=c.label_smoothing,
        runtime=RuntimeConfig(mesh=(c.mesh.data, c.mesh.fsdp, c.mesh.tensor), cpu_devices=c.cpu_devices,
                              compilation_cache_dir=c.compilation_cache_dir,
                              distributed=DistributedConfig(**c.distributed.to_dict())),
        sample=SampleConfig(**c.sample.to_dict()), batch_size=c.batch_size, grad_accum=c.grad_accum,
        max_steps=c.max_steps, log_interval=c.log_interval, eval_interval=c.eval_interval,
        eval_batches=c.eval_batches, ckpt_interval=c.ckpt_interval, keep_checkpoints=c.keep_checkpoints,
        resume=c.resume, settings=json.loads(c.to_json()), loss_chunk=c.loss_chunk,
        resume_changes=c.resume_changes, resume_fallback=c.resume_fallback, wandb_project=c.wandb.project,
        wandb_name=c.wandb.name)
