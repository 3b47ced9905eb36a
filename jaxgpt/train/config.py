"""The run configuration: typed dataclasses are the schema; the ConfigDict config files edit is derived from them.

Every key, its type, its default and its range check live in one dataclass below: `base_config()` turns the
defaults into the ConfigDict that config files in `configs/` start from and `--config.key=value` overrides
(so a misspelled key is an error and a value of the wrong type is rejected by ml_collections), and
`from_config_dict` turns the edited ConfigDict back into the dataclasses with one generic conversion. Adding a
key is one line in its dataclass (with its default and a comment); its check, if it needs one, goes in that
dataclass's `__post_init__`. The library reads only typed configs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import typing
from typing import Any, ClassVar

from ml_collections import ConfigDict, config_dict

from jaxgpt import storage
from jaxgpt.data.conversations import Conversations
from jaxgpt.data.preferences import PreferenceConfig
from jaxgpt.errors import UserError
from jaxgpt.generate.sampling import MAX_NEW_TOKENS
from jaxgpt.model.config import ModelConfig, model_config_from_dict
from jaxgpt.model.lora import LoRAConfig
from jaxgpt.model.presets import get_preset
from jaxgpt.train import renamed
from jaxgpt.train.optim import OptimConfig
from jaxgpt.train.task import TASKS

# Model fields whose default is derived from others (None in ModelConfig) become typed placeholders: every field
# typed "T | None", and vocab_size (None: the dataset's).
_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_UNSET_TYPES = {"vocab_size": int, **{f.name: _TYPES[f.type.split(" | ")[0]] for f in dataclasses.fields(ModelConfig)
                                      if f.type.endswith(" | None")}}


# The keys that name a file or directory, and what each takes (`storage.check`): all checked before anything
# runs. workdir, data.dir and the cache may be bucket URLs; a built-in dataset's name is no path and passes.
LOCATION_KEYS = {"workdir": storage.ANYWHERE, "init_from": storage.SOURCE, "data.dir": storage.ANYWHERE,
                 "data.bpe_file": storage.LOCAL, "data.csv": storage.LOCAL, "classify.data": storage.LOCAL,
                 "seq2seq.data": storage.LOCAL, "chat.data": storage.LOCAL, "rl.data": storage.LOCAL,
                 "dpo.data": storage.LOCAL, "eval.hellaswag_data": storage.LOCAL,
                 "compilation_cache_dir": storage.ANYWHERE}


def _at_least(where: str, values: dict[str, Any], low: int) -> None:
    for key, value in values.items():
        if value < low:
            raise UserError(f"config.{where}{key}={value} must be >= {low}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = "stdlib_char"  # a built-in dataset, prepared into `dir` on first use ("" = one prepared by hand)
    dir: str = "data/stdlib_char"  # a prepared dataset (jaxgpt data ...)
    bpe_file: str = ""  # GPT-2 ranks file for BPE tokenizers when offline (or env JAXGPT_BPE_FILE)
    csv: str = ""  # wine_reviews: Kaggle's winemag-data-130k-v2.csv (a login is needed to download it)
    # language modelling: every window starts at a document boundary (an end-of-text token, which then leads the
    # window), as nanochat and modded-nanogpt align their batches; still a pure function of (seed, step)
    align_documents: bool = False


@dataclasses.dataclass(frozen=True)
class ClassifyConfig:
    """Task "classify": the model, tokenizer and body weights come from init_from."""

    data: str = "stdlib_packages"  # a built-in dataset name, or a .csv / .jsonl file of (text, label)
    val_fraction: float = 0.2  # held out for accuracy (stratified by class)
    max_len: int | None = None  # tokens per row incl. the classification token
    cls_token: str = ""  # "" = end-of-text for BPE models, "\n" for char models
    lm_weight: float = 0.5  # weight of the auxiliary language-model loss (GPT-1: 0.5)
    cls_dropout: float = 0.1  # dropout on the hidden state before the classification head

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"config.classify.val_fraction={self.val_fraction} must be between 0 and 1 (exclusive), "
                            "e.g. 0.2")
        if self.lm_weight < 0:
            raise UserError(f"config.classify.lm_weight={self.lm_weight} must be >= 0")
        if not 0.0 <= self.cls_dropout < 1.0:
            raise UserError(f"config.classify.cls_dropout={self.cls_dropout} must be in [0, 1)")
        if self.max_len is not None and self.max_len < 2:
            raise UserError(f"config.classify.max_len={self.max_len} must be >= 2 (a text token and the class token)")


@dataclasses.dataclass(frozen=True)
class Seq2SeqTaskConfig:
    """Task "seq2seq": jaxgpt/tasks/seq2seq.py (model.n_layer counts the decoder's layers)."""

    data: str = "copy"  # built-in "copy", "reverse", "stdlib_identifiers", or a .tsv/.txt/.jsonl file of pairs
    val_fraction: float = 0.05  # pairs held out (by a hash of the source) for loss, accuracy and exact match
    tokenizer: str = "char"  # one text tokenizer for sources and targets: "char" or "word"
    word_vocab: int = 10000  # tokenizer "word": vocabulary size incl. [PAD] and [UNK]
    examples: int = 20000  # "copy" / "reverse": random strings generated (train + held-out)
    symbols: int = 10  # "copy" / "reverse": alphabet size
    length: int = 10  # "copy" / "reverse": longest string (lengths are uniform in [1, length])
    n_encoder_layer: int = 2
    share_embeddings: bool = True  # one token table for sources and targets (they share the tokenizer)

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"config.seq2seq.val_fraction={self.val_fraction} must be between 0 and 1 (exclusive), "
                            "e.g. 0.05")
        _at_least("seq2seq.", {k: getattr(self, k) for k in ("word_vocab", "examples", "symbols", "length",
                                                               "n_encoder_layer")}, 1)


@dataclasses.dataclass(frozen=True)
class ChatConfig(Conversations):
    """Task "chat": supervised fine-tuning on conversations (jaxgpt/tasks/chat.py); model and tokenizer from
    init_from, the chat format's special tokens added to that tokenizer."""

    group: ClassVar[str] = "chat"
    pack: bool = False  # training rows hold several conversations, none seeing another (GPT.hidden's segments)


@dataclasses.dataclass(frozen=True)
class RLConfig(Conversations):
    """Task "rl": GRPO on rewards a program checks (jaxgpt/tasks/rl/task.py), from init_from; prompts are the
    conversations of data/datasets less their last assistant turn (the answer); batch_size counts completions
    (prompts x groups)."""

    group: ClassVar[str] = "rl"
    # "exact" (the reply equals the answer), "module:function" or "path/file.py:function" taking (prompt messages,
    # completion text) -> float, or several comma-separated, each optionally weighted: "exact=1,my_rewards:brevity=0.1"
    reward: str = "exact"
    num_generations: int = 8  # completions sampled per prompt: one group, whose rewards are normalized together
    max_new_tokens: int = 48  # a completion's longest (less where the prompt leaves less of the context)
    temperature: float = 1.0  # of the rollouts, and of the log-probabilities the loss takes
    top_p: float = 1.0
    loss_type: str = "dapo"  # "grpo" (sequence mean), "dr_grpo" (no std division, constant length), "dapo" (token mean)
    epsilon: float = 0.2  # the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher: 0.28)
    beta: float = 0.0  # weight of the KL penalty to the frozen starting model (0: none, as current practice)
    num_iterations: int = 1  # optimizer steps per batch of rollouts (> 1: importance ratios to the sampling policy)
    # True: a completion cut at max_new_tokens leaves the loss, not teaching early stops (DAPO's overlong filtering)
    mask_truncated_completions: bool = False
    slots: int = 64  # the engine's slots while sampling rollouts and evaluations
    eval_prompts: int = 256  # held-out prompts scored at each evaluation (greedy pass@1 and sampled pass@k)
    pass_k: int = 8  # k of pass@k: completions sampled per held-out prompt

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in ("grpo", "dr_grpo", "dapo"):
            raise UserError(f"config.rl.loss_type={self.loss_type!r} is unknown: choose grpo, dr_grpo or dapo")
        _at_least("rl.", {"num_generations": self.num_generations}, 2)  # a group of one has no baseline
        _at_least("rl.", {k: getattr(self, k) for k in ("max_new_tokens", "num_iterations", "slots", "eval_prompts",
                                                          "pass_k")}, 1)
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or min(self.epsilon, self.epsilon_high or 0, self.beta) < 0:
            raise UserError(f"config.rl: temperature={self.temperature} must be > 0, top_p={self.top_p} in (0, 1], "
                            f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high} and beta={self.beta} >= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh's axis sizes; one -1 takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    enabled: bool = False  # call jax.distributed.initialize (auto-detects TPU VMs and SLURM)
    coordinator_address: str = ""  # host:port of process 0, when not auto-detected
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = 120  # seconds to wait for all processes
    heartbeat_timeout: int = 30  # seconds before a dead peer aborts the others


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Benchmarks scored at every evaluation of a language-modelling run (`jaxgpt.evals.benchmarks`)."""

    hellaswag: bool = False  # HellaSwag accuracy, logged as eval/hellaswag_acc_norm and eval/hellaswag_acc
    hellaswag_data: str = ""  # its validation JSONL ("": downloaded once into $JAXGPT_CACHE, ~/.cache/jaxgpt)
    hellaswag_examples: int = 0  # the first N examples (0: all of them)

    def __post_init__(self) -> None:
        if self.hellaswag_examples < 0:
            raise UserError(f"config.eval.hellaswag_examples={self.hellaswag_examples} must be >= 0 (0: all)")


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """The sample printed when a language-model run ends."""

    max_new_tokens: int = 400
    prompt: str = "\n"
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"config.sample.max_new_tokens={self.max_new_tokens} must be in [0, {MAX_NEW_TOKENS}]")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UserError(f"config.sample: temperature={self.temperature} and top_k={self.top_k} must be >= 0, "
                            f"top_p={self.top_p} in (0, 1]")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str = ""  # a project name logs to Weights & Biases (pip install wandb)
    name: str = ""


def _default_model() -> ModelConfig:
    return get_preset("gpt2")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run: every key of the ConfigDict, in its order, typed and checked; what the loop and tasks read."""

    task: str = "lm"  # a key of jaxgpt.train.task.TASKS; a task's settings are the group of its name (c.classify, ...)
    workdir: str = ""  # where checkpoints, logs and the resolved config go (required): a path, gs:// or s3:// URL
    seed: int = 0  # data order, init and dropout all derive from it
    # GPT-2's shape; vocab_size unset in the ConfigDict: the dataset's (`vocab_from_data`)
    model: ModelConfig = dataclasses.field(default_factory=_default_model)
    init_from: str = ""  # "" or a source of `jaxgpt.io.weights`: hf:, gguf:, peft:, workdir: (a jaxgpt run), preset:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    classify: ClassifyConfig = dataclasses.field(default_factory=ClassifyConfig)
    seq2seq: Seq2SeqTaskConfig = dataclasses.field(default_factory=Seq2SeqTaskConfig)
    chat: ChatConfig = dataclasses.field(default_factory=ChatConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)  # lm, chat, rl, dpo: adapters on init_from
    dpo: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    label_smoothing: float = 0.0  # lm and seq2seq: targets smoothed toward uniform (optax.smooth_labels; paper: 0.1)
    loss_chunk: int = 0  # language modelling: positions per chunk of the cross-entropy (0: all logits at once)
    z_loss: float = 0.0  # lm: weight of mean(logsumexp(logits)^2) added to the training loss (PaLM: 1e-4; 0: off)
    batch_size: int = 32  # global sequences per optimizer step, summed over micro-batches and hosts
    grad_accum: int = 1  # micro-batches per step (batch_size / grad_accum sequences each)
    max_steps: int = 2000
    # optim.decay_steps is unset in the ConfigDict: max_steps
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    log_interval: int = 10
    eval_interval: int = 250
    eval_batches: int = 20  # language modelling: batches per evaluation (classification uses all held-out rows)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    ckpt_interval: int = 500  # also saved after every evaluation and at the end
    ckpt_minutes: float = 0.0  # > 0: also save when this much wall-clock time passed since the last save
    lease_seconds: float = 60.0  # a run in a bucket renews its lease this often; one not renewed is taken over
    keep_checkpoints: int = 2  # the last N, plus the best by validation loss
    resume: bool = True  # continue from the work directory's latest checkpoint when it has one
    resume_changes: bool = False  # resume even though settings that change the run's trajectory differ
    resume_fallback: bool = False  # resume from the newest readable checkpoint when the latest cannot be read
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    cpu_devices: int = 0  # > 0: split each host's CPU into this many XLA devices (data parallel); 0: JAX's default
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    compilation_cache_dir: str = "~/.cache/jaxgpt/xla"  # persistent XLA cache ("" disables)
    # GPUs: XLA's deterministic ops (fixed-order sums, no atomics) for a bit-exact resume; CPUs and TPUs always are
    deterministic: bool = False
    tensorboard: bool = True  # event files in WORKDIR/tensorboard; off: no tensorboardX, whose torch import is slow
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    # Derived by from_config_dict, not keys: the vocabulary comes from the dataset; the ConfigDict as JSON.
    vocab_from_data: bool = dataclasses.field(default=False, metadata={"derived": True})
    settings: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False,
                                                 metadata={"derived": True})

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise UserError(f"config.task={self.task!r} is unknown: choose one of {', '.join(TASKS)}")
        if not self.workdir:
            raise UserError("config.workdir is empty: pass --config.workdir=DIR (where checkpoints and logs go)")
        for key, kind in LOCATION_KEYS.items():
            if value := functools.reduce(getattr, key.split("."), self):
                storage.check(value, f"config.{key}", kind)
        _at_least("", {k: getattr(self, k) for k in ("batch_size", "grad_accum", "max_steps", "log_interval",
                                                     "eval_interval", "eval_batches", "ckpt_interval",
                                                     "keep_checkpoints")}, 1)
        if self.batch_size % self.grad_accum:
            raise UserError(f"config.batch_size={self.batch_size} is not divisible by "
                            f"config.grad_accum={self.grad_accum}")
        if self.loss_chunk < 0:
            raise UserError(f"config.loss_chunk={self.loss_chunk} must be >= 0 (0 computes all logits at once)")
        if self.ckpt_minutes < 0:
            raise UserError(f"config.ckpt_minutes={self.ckpt_minutes} must be >= 0 (0 saves by steps only)")
        if self.lease_seconds < 3:
            raise UserError(f"config.lease_seconds={self.lease_seconds} must be >= 3 (it is renewed every third)")
        if self.cpu_devices < 0:
            raise UserError(f"config.cpu_devices={self.cpu_devices} must be >= 0 (0 keeps JAX's default of one "
                            "CPU device)")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"config.label_smoothing={self.label_smoothing} must be in [0, 1) (the paper's is 0.1)")
        if self.label_smoothing and self.task == "classify":
            raise UserError("config.label_smoothing applies to tasks lm and seq2seq: set it to 0 for classify")
        if self.lora.rank and (self.task not in ("lm", "chat", "rl", "dpo") or not self.init_from):
            raise UserError(f"config.lora adapts a language model's init_from: it needs task lm, chat, rl or dpo (not "
                            f"{self.task!r}) and --config.init_from (the frozen base)")
        if self.eval.hellaswag and self.task != "lm":
            raise UserError(f"config.eval.hellaswag scores a language model: leave it False for task {self.task!r}")
        if self.z_loss < 0 or (self.z_loss and self.task != "lm"):
            raise UserError(f"config.z_loss={self.z_loss} must be >= 0 and applies to task lm only (0 turns it off)")
        if self.task == "rl" and self.batch_size % self.rl.num_generations:
            raise UserError(f"config.batch_size={self.batch_size} counts completions: make it a multiple of "
                            f"config.rl.num_generations={self.rl.num_generations}")
        if self.label_smoothing and self.loss_chunk:
            raise UserError("config.label_smoothing needs the dense loss: set config.loss_chunk=0")

    def with_model(self, model: ModelConfig) -> TrainConfig:
        return dataclasses.replace(self, model=model, vocab_from_data=False)


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
    """The ConfigDict of TrainConfig's defaults: every key a config file or `--config.key=value` may set."""
    c = _as_config_dict(TrainConfig(workdir="-"))
    c.workdir = ""  # required: from_config_dict refuses it empty
    c.model = model_fields(get_preset("gpt2"), vocab_size=None)  # vocab_size None: the dataset's
    c.optim.decay_steps = config_dict.placeholder(int)  # None: max_steps
    renamed.add_aliases(c)
    return c


def _as_config_dict(obj: Any) -> ConfigDict:
    """A dataclass's keys (its derived fields left out) as a ConfigDict; None defaults become typed placeholders."""
    hints = typing.get_type_hints(type(obj))
    c = ConfigDict()
    for f in dataclasses.fields(obj):
        if f.metadata.get("derived"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            c[f.name] = _as_config_dict(value)
        elif value is None:
            c[f.name] = config_dict.placeholder(next(a for a in typing.get_args(hints[f.name]) if a is not type(None)))
        else:
            c[f.name] = value
    return c


def _from_dict(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """`cls` from a nested dict of its keys: an unknown key is a UserError naming it, with the nearest known one."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    for key in values:
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            raise UserError(f"config.{prefix}{key} is not a config key" + (f": did you mean {prefix}{near[0]}?"
                                                                           if near else ""))
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and not isinstance(value, hint):
            if not isinstance(value, dict):
                raise UserError(f"config.{prefix}{name} must be a group of keys, not {value!r}")
            value = _from_dict(hint, value, f"{prefix}{name}.")
        kwargs[name] = value
    return cls(**kwargs)


def non_finite(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of every NaN or infinite float in a nested dict (they would surface only as a NaN loss)."""
    bad = []
    for key, value in values.items():
        if isinstance(value, dict):
            bad += non_finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(f"{prefix}{key}={value}")
    return bad


def from_config_dict(c: ConfigDict) -> TrainConfig:
    """Check a ConfigDict (a config file plus command-line overrides) and build the typed config."""
    renamed.rl_prompts_from_chat(c, base_config())
    values = c.to_dict()
    renamed.drop_aliases(values)
    if bad := non_finite(values):
        raise UserError(f"config values must be finite numbers: {', '.join(bad)}")
    if values.get("optim", {}).get("eps", 1.0) <= 0:
        raise UserError(f"config.optim.eps={values['optim']['eps']} must be > 0 (e.g. 1e-8): it keeps Adam's "
                        "division finite")
    if not 0 <= values.get("seed", 0) < 2**63:
        raise UserError(f"config.seed={values['seed']} must be in [0, 2**63)")
    model = dict(values.pop("model", {}))
    vocab_from_data = model.get("vocab_size") is None
    if vocab_from_data:
        model["vocab_size"] = 1  # replaced by the dataset's vocabulary before anything is built
    optim = dict(values.pop("optim", {}))
    if optim.get("decay_steps") is None:
        optim["decay_steps"] = max(values.get("max_steps", TrainConfig.max_steps),
                                   optim.get("warmup_steps", OptimConfig.warmup_steps) + 1)
    typed = {**values, "model": model_config_from_dict(model), "optim": _from_dict(OptimConfig, optim, "optim.")}
    cfg = _from_dict(TrainConfig, typed, "")
    return dataclasses.replace(cfg, vocab_from_data=vocab_from_data, settings=json.loads(c.to_json()))


def schedule(c: ConfigDict, *, max_steps: int, lr: float, min_lr: float, warmup_steps: int, eval_interval: int,
             eval_batches: int | None = None, weight_decay: float | None = None, b2: float | None = None
             ) -> ConfigDict:
    """Set the block every config writes: steps, learning-rate schedule, AdamW's decay and b2, evaluation.

    Arguments left None keep base_config()'s values.
    """
    c.max_steps, c.eval_interval = max_steps, eval_interval
    c.optim.lr, c.optim.min_lr, c.optim.warmup_steps = lr, min_lr, warmup_steps
    for key, value in (("optim.weight_decay", weight_decay), ("optim.b2", b2), ("eval_batches", eval_batches)):
        if value is not None:
            c.update_from_flattened_dict({key: value})
    return c


def pod_config(preset: str, workdir: str, *, batch_size: int, grad_accum: int, max_steps: int, lr: float,
               min_lr: float, eval_batches: int, vocab_size: int = 50304) -> ConfigDict:
    """A large GPT on the OpenWebText-style corpus (GPT-2 BPE), laid out for pod slices.

    bf16 compute with fp32 parameters and optimizer state, the platform's fused attention (splash on TPU,
    cuDNN on GPU), a chunked loss (never all float32 logits at once), scanned and fully rematerialized
    layers, parameters and optimizer state sharded over every chip (FSDP), the vocabulary padded to 50304
    so it splits over tensor-parallel devices. The configs/gpt2_*.py and gpt_6.7b.py files differ only in
    the arguments; an open-weight model's (configs/llama_3.1_8b.py) keeps its own `vocab_size`.
    """
    c = base_config()
    c.workdir = workdir
    c.data.name = "openwebtext"
    c.data.dir = "data/openwebtext"
    c.model = model_fields(get_preset(preset), vocab_size=vocab_size, dtype="bfloat16", param_dtype="float32",
                           attention_impl="auto", scan_layers=True, remat="full")
    c.loss_chunk = 128
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.batch_size = batch_size
    c.grad_accum = grad_accum
    c.ckpt_interval = 1000
    c.log_interval = 10
    return schedule(c, max_steps=max_steps, lr=lr, min_lr=min_lr, warmup_steps=2000, eval_interval=1000,
                    eval_batches=eval_batches, weight_decay=0.1, b2=0.95)
