"""Language modelling: next-token cross-entropy on a prepared token dataset.

The batch of step i is `batch_for_step(seed, i)` (random windows of block_size + 1 tokens), so resuming
needs no iterator state; evaluation batches are fixed per split, so losses compare across a run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxgpt import storage
from jaxgpt.data.batches import batch_for_step, check_shapes, document_starts, eval_batches
from jaxgpt.data.corpora import prepare_builtin
from jaxgpt.data.dataset import META_FILE, Dataset, load_dataset, unknown_summary
from jaxgpt.data.tokenizer import describe_tokenizer, same_tokenizer, tokenizer_from_meta
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, dummy_tokens
from jaxgpt.ops.loss import chunked_cross_entropy, cross_entropy, z_loss
from jaxgpt.train.config import DataConfig, TrainConfig, base_config


def _check_data_keys(data: DataConfig) -> None:
    """Refuse a data.dir that cannot be what the user meant, before anything is written.

    A built-in dataset is prepared on first use only into a directory named after it (data/stdlib_char):
    anywhere else, a missing dataset with data.name still set is almost always a typo in data.dir or own
    data that was not prepared, and preparing the built-in there would train on the wrong text silently.
    """
    if not data.dir:
        raise UserError("config.data.dir is empty: prepare your text (jaxgpt data --text FILE... --out data/mine) "
                        "and pass --config.data.dir=data/mine")
    data_dir = storage.location(data.dir, "config.data.dir")
    with storage.guard(data_dir, "reading"):
        prepared = (data_dir / META_FILE).exists()
    if data.name and not prepared and storage.is_bucket(data_dir):
        raise UserError(f"config.data.dir={data.dir} holds no prepared dataset: built-in datasets are prepared on "
                        f"first use only on local disk; run `jaxgpt data --dataset {data.name} --out {data.dir}` first")
    if data.name and not prepared and data_dir.name != data.name:
        raise UserError(f"config.data.dir={data.dir} holds no prepared dataset, and config.data.name={data.name} "
                        f"would be prepared only into a directory named {data.name}: for your own text, run `jaxgpt "
                        f"data --text FILE... --out {data.dir}` and pass --config.data.name= ; for {data.name}, "
                        f"fix --config.data.dir (e.g. data/{data.name})")


def open_dataset(data: DataConfig) -> Dataset:
    """Load the prepared dataset, preparing a built-in one on first use."""
    _check_data_keys(data)
    data_dir = storage.location(data.dir, "config.data.dir")
    bpe_file = data.bpe_file or None

    def prepare_if_missing() -> None:
        if data.name and not storage.is_bucket(data_dir) and not (data_dir / META_FILE).exists():
            if jax.process_index() == 0:
                print(f"preparing dataset {data.name} in {data_dir} ...", flush=True)
            meta = prepare_builtin(data.name, data_dir, bpe_file=bpe_file, csv_path=data.csv or None)
            if jax.process_index() == 0 and (unknown := unknown_summary(meta)):
                print(unknown, flush=True)

    if jax.process_count() == 1:
        prepare_if_missing()
    else:  # process 0 first: on a shared filesystem the others then find it ready instead of racing it
        if jax.process_index() == 0:
            prepare_if_missing()
        multihost_utils.sync_global_devices("jaxgpt-dataset-ready")
        prepare_if_missing()  # host-local disks: every host needs its own copy
    return load_dataset(data.dir, bpe_file=bpe_file)


def from_config(cfg: TrainConfig) -> LanguageModelling:
    """The `lm` task of a run (`jaxgpt.tasks.build`): its prepared dataset opened, a built-in one prepared first,
    and HellaSwag scored at each evaluation (`Task.benchmarks`) when config.eval.hellaswag asks (its file is read
    here, before training)."""
    task = LanguageModelling(cfg, open_dataset(cfg.data))
    if cfg.eval.hellaswag:
        from jaxgpt.evals.benchmarks import DuringTraining  # the evals package loads only for runs that use it

        tokenizer = tokenizer_from_meta(task.tokenizer_meta, cfg.data.bpe_file or None)
        task.benchmarks = DuringTraining(cfg.eval, task.model_cfg, tokenizer, task.eval_rows_per_batch)
    return task


def model_for(cfg: TrainConfig, dataset: Dataset | None) -> ModelConfig:
    """The model to train: the config's, or with `init_from` the weights' architecture (`weights.fit_architecture`).

    Either way the dataset must fit it: its vocabulary within the model's, and, for pretrained weights with
    a known tokenizer, the same tokenizer (GPT-2 BPE data for a GPT-2 model).
    """
    model_cfg, weights_tokenizer = cfg.model, None
    if cfg.init_from:
        defaults = base_config().model.to_dict()
        model_cfg, weights_tokenizer = weights.fit_architecture(cfg.init_from, cfg.model, defaults,
                                                                cfg.vocab_from_data)
    if dataset is None:
        return model_cfg
    vocab = dataset.meta["vocab_size"]
    if cfg.vocab_from_data and not cfg.init_from:
        model_cfg = model_cfg.replace(vocab_size=vocab)
    elif model_cfg.vocab_size < vocab and cfg.init_from:
        raise UserError(f"the dataset's vocabulary ({vocab} tokens) is larger than init_from {cfg.init_from}'s "
                        f"({model_cfg.vocab_size}): prepare the data with the weights' tokenizer")
    elif model_cfg.vocab_size < vocab:
        raise UserError(f"config.model.vocab_size={model_cfg.vocab_size} is smaller than the dataset's "
                        f"vocabulary ({vocab}): raise it or leave it unset")
    if weights_tokenizer is not None and not same_tokenizer(weights_tokenizer, dataset.meta["tokenizer"]):
        raise UserError(f"init_from {cfg.init_from} was trained with {describe_tokenizer(weights_tokenizer)}, "
                        f"but config.data.dir={cfg.data.dir} uses {describe_tokenizer(dataset.meta['tokenizer'])}: "
                        "prepare the data with the weights' tokenizer (jaxgpt data --tokenizer gpt2 for GPT-2)")
    for split in ("train", "val"):  # a block size the data cannot fill fails before anything is written
        check_shapes(len(getattr(dataset, split)), 1, model_cfg.block_size, split)
    return model_cfg


def _document_starts(dataset: Dataset | None, block_size: int) -> dict[str, np.ndarray]:
    """Per split, the document boundaries windows may start at (`data.align_documents`)."""
    if dataset is None or dataset.eot_token is None:
        raise UserError("config.data.align_documents needs documents separated by an end-of-text token (BPE or "
                        "word data; a character dataset has none): set it to False")
    return {split: document_starts(getattr(dataset, split).boundaries(dataset.eot_token), len(getattr(dataset, split)),
                                   block_size) for split in ("train", "val")}


class LanguageModelling:
    """A GPT on a token dataset. `dataset=None` gives the model and objective only (ahead-of-time compiles)."""

    batch_ndims: ClassVar[dict[str, int]] = {"x": 2, "y": 2}

    def __init__(self, cfg: TrainConfig, dataset: Dataset | None) -> None:
        model_cfg = model_for(cfg, dataset)
        if cfg.loss_chunk and model_cfg.block_size % cfg.loss_chunk:
            raise UserError(f"config.loss_chunk={cfg.loss_chunk} does not divide model.block_size="
                            f"{model_cfg.block_size}: use a divisor (e.g. 128) or 0")
        self.cfg, self.dataset, self.model_cfg = cfg, dataset, model_cfg
        self.model = GPT(model_cfg)
        self.tokenizer_meta = dataset.meta["tokenizer"] if dataset is not None else {}
        self.meta = {"dataset": dataset.meta if dataset is not None else {}}
        self.tokens_per_row = model_cfg.block_size
        self.eval_rows_per_batch = cfg.batch_size // cfg.grad_accum
        self.starts = _document_starts(dataset, model_cfg.block_size) if cfg.data.align_documents else {}
        self._dropout = model_cfg.any_dropout

    def example_inputs(self) -> tuple[jax.Array]:
        return (dummy_tokens(self.model_cfg),)

    def _loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array | None) -> jax.Array:
        """Mean cross-entropy: from all logits at once, or `loss_chunk` positions at a time (same value).

        Training smooths the targets (`label_smoothing`) and adds the z-loss (`z_loss`); evaluation (`key`
        None) reports the plain loss."""
        dropout = self._dropout and key is not None
        kwargs = {"deterministic": not dropout, "rngs": {"dropout": key} if dropout else None}
        z_weight = self.cfg.z_loss if key is not None else 0.0
        if not self.cfg.loss_chunk:
            smoothing = self.cfg.label_smoothing if key is not None else 0.0
            logits_BTV = self.model.apply({"params": params}, batch["x"], **kwargs)
            loss = cross_entropy(logits_BTV, batch["y"], smoothing)
            return loss + z_weight * z_loss(logits_BTV).mean() if z_weight else loss
        h_BTC = self.model.apply({"params": params}, batch["x"], method=GPT.hidden, **kwargs)
        head = lambda h: self.model.apply({"params": params}, h, method=GPT.logits)
        return chunked_cross_entropy(head, h_BTC, batch["y"], self.cfg.loss_chunk, z_weight)

    def loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict]:
        return self._loss(params, batch, key), {}

    def evaluate(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return self._loss(params, batch, None)

    def pretrained(self) -> Any | None:
        if not self.cfg.init_from:
            return None
        return jax.device_get(weights.load_for(self.cfg.init_from, self.model_cfg).params)

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        weights.require_same_run(saved_meta, self.model_cfg, workdir, "use the same model config")

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        x, y = batch_for_step(self.dataset.train, seed=self.cfg.seed, step=step, batch_size=self.cfg.batch_size,
                              block_size=self.model_cfg.block_size, process_index=process_index,
                              process_count=process_count, starts=self.starts.get("train"))
        return {"x": x, "y": y}

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        return {split: [{"x": x, "y": y} for x, y in eval_batches(
            getattr(self.dataset, split), batch_size=self.eval_rows_per_batch, block_size=self.model_cfg.block_size,
            n_batches=self.cfg.eval_batches, seed=self.cfg.seed, split=split, process_index=process_index,
            process_count=process_count, starts=self.starts.get(split))] for split in ("train", "val")}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        return {f"{split}_loss": float(np.mean(losses)) for split, losses in outputs.items()}

    def describe(self) -> str:
        return ""

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        line = f"step {step}: train loss {metrics['train_loss']:.4f}, val loss {metrics['val_loss']:.4f}"
        return line + (f", hellaswag acc_norm {metrics['hellaswag_acc_norm']:.4f}" if "hellaswag_acc_norm" in metrics
                       else "")

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return None

