"""Classification fine-tuning with seed 001's head: LM logits plus class logits read at a classification token.

GPT-1's recipe: append a classification token to each text, read the final hidden state there through a
new linear head (`GPTClassifier.cls_head`), and train on

    loss = cross_entropy(class logits, label) + lm_weight * next-token loss on the text,

the language-model term acting as a regularizer that keeps the pretrained features (GPT-1 used 0.5).
The model, tokenizer and body weights come from `init_from` (a jaxgpt run, a classifier run, or a
Hugging Face directory, `jaxgpt.io.weights`); the data from `jaxgpt.data.classify_data`. It trains on the one loop:

    python train.py --config configs/classify_stdlib.py [--config.key=value ...]

From Python: `predict(workdir, texts) -> labels`, or `load_classifier(workdir).predict(texts)` for repeated use.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.data.batches import filler_batches, fixed_batches, process_share, spread_indices, step_rows
from jaxgpt.data.classify_data import (
    Label,
    cls_token_id,
    encode_task,
    encode_texts,
    load_task,
    majority_baseline,
)
from jaxgpt.data.tokenizer import Tokenizer, tokenizer_from_meta
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.gpt import GPTClassifier, dummy_tokens
from jaxgpt.ops.loss import masked_mean, token_nll
from jaxgpt.train.config import TrainConfig

Batch = dict[str, jax.Array]  # x (B, T) int32, mask (B, T) bool, label (B,) int32, weight (B,) float32
TRAIN_EVAL_EXAMPLES = 256  # training accuracy is measured on a fixed, class-spread sample of this size


def classification_loss(lm_logits_BTV: jax.Array, cls_logits_BK: jax.Array, batch: Batch,
                        lm_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Seed 001 / GPT-1 fine-tuning loss: class cross-entropy + lm_weight * next-token cross-entropy.

    Both are means over real items: the class term over rows (weighted, so filler rows count nothing), the
    language-model term over text tokens that predict a following text token; padding and the appended
    classification token (which is not part of the text) are never targets.
    """
    w_B = batch["weight"]
    cls_B = token_nll(cls_logits_BK, batch["label"])
    cls_loss = masked_mean(cls_B, w_B)
    # Position t predicts t+1 for t < T-2: the last column holds the classification token, never a target.
    mask_BT = batch["mask"]
    target_BT = mask_BT[:, :-2] & mask_BT[:, 1:-1]
    tok_BT = token_nll(lm_logits_BTV[:, :-2], batch["x"][:, 1:-1])
    tok_w_BT = target_BT * w_B[:, None]
    lm_loss = masked_mean(tok_BT, tok_w_BT)
    return cls_loss + lm_weight * lm_loss, {"cls_loss": cls_loss, "lm_loss": lm_loss}


def language_model(source: str, max_len: int | None) -> weights.Weights:
    """The body to fine-tune: a language model, or a classifier's body without its head."""
    if not source:
        raise UserError("config.init_from is empty: pass --config.init_from=workdir:PATH (a jaxgpt language model "
                        "run) or hf:PATH (a Hugging Face directory)")
    loaded = weights.load(source, block_size=max_len if source.startswith(weights.CROPPED) else None)
    weights.require_gpt(source, loaded.model, "be fine-tuned as a classifier")
    if "cls_head" not in loaded.params:
        return loaded
    return dataclasses.replace(loaded, params={k: v for k, v in loaded.params.items() if k != "cls_head"})


class Classification:
    """Seed 001's fine-tuning task on the loop: its data, head, loss and evaluation."""

    batch_ndims: ClassVar[dict[str, int]] = {"x": 2, "mask": 2, "label": 1, "weight": 1}

    def __init__(self, cfg: TrainConfig) -> None:
        k = cfg.classify
        examples = load_task(k.data, k.val_fraction, cfg.seed)  # bad data fails before a large model is read
        self.body = language_model(cfg.init_from, k.max_len)
        tokenizer = self.body.tokenizer(cfg.data.bpe_file or None)
        cls_id = cls_token_id(tokenizer, k.cls_token)
        task = encode_task(examples, tokenizer, cls_id, k.max_len, self.body.model.block_size)
        self.cfg, self.data, self.names, self.width = cfg, task.data, task.names, task.width
        self.model_cfg = self.body.model
        self.model = GPTClassifier(self.model_cfg, n_class=len(task.names), cls_token_id=cls_id,
                                   cls_dropout=k.cls_dropout)
        self.tokenizer_meta = tokenizer.to_meta()
        n_train, n_val = len(task.data["train"]["x"]), len(task.data["val"]["x"])
        self.majority, self.baseline = majority_baseline(task.data["train"]["label"], task.data["val"]["label"])
        self.eval_idx = {"val": np.arange(n_val), "train": spread_indices(n_train, min(n_val, TRAIN_EVAL_EXAMPLES))}
        self.tokens_per_row = task.width
        self.eval_rows_per_batch = cfg.batch_size
        self.meta = {"classifier": {
            "labels": task.names, "n_class": len(task.names), "cls_token_id": cls_id, "max_len": task.width,
            "cls_dropout": k.cls_dropout, "lm_weight": k.lm_weight, "init_from": cfg.init_from,
            "data": task.description, "majority_baseline": self.baseline}}
        self._description = (f"{task.description}\n{len(task.names)} classes {task.names}; {n_train} train / {n_val} "
                             f"held-out examples, {task.width} tokens per row; majority-class baseline "
                             f"{self.baseline:.3f} ({task.names[self.majority]!r})")

    def example_inputs(self) -> tuple[jax.Array]:
        return (dummy_tokens(self.model_cfg),)

    def loss(self, params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]:
        lm, cls = self.model.apply({"params": params}, batch["x"], batch["mask"], deterministic=False,
                                   rngs={"dropout": key})
        return classification_loss(lm, cls, batch, self.cfg.classify.lm_weight)

    def evaluate(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        """Weighted sums for one batch (dropout off), so batches of any fill combine exactly, plus predictions."""
        lm, cls = self.model.apply({"params": params}, batch["x"], batch["mask"])
        _, parts = classification_loss(lm, cls, batch, self.cfg.classify.lm_weight)
        n = jnp.sum(batch["weight"])
        pred_B = jnp.argmax(cls, axis=-1)
        return {"n": n, "correct": jnp.sum((pred_B == batch["label"]) * batch["weight"]),
                "cls_loss": parts["cls_loss"] * n, "lm_loss": parts["lm_loss"] * n, "pred": pred_B}

    def pretrained(self) -> Any:
        return jax.device_get(self.body.params)

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        saved = saved_meta.get("classifier", {})
        weights.require_same_run(saved_meta, self.model_cfg, workdir, "use the same config and data",
                                 **{k: (saved.get(k), self.meta["classifier"][k])
                                    for k in ("labels", "cls_token_id", "max_len")})

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        return step_rows(self.data["train"], self.cfg.seed, step, self.cfg.batch_size, process_index, process_count)

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        share = process_share(self.cfg.batch_size, process_index, process_count)
        return {part: filler_batches(self.data[part], idx, self.cfg.batch_size, ("weight",), share)
                for part, idx in self.eval_idx.items()}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Accuracy, mean losses and per-class accuracy per split; val_loss is the class loss (best checkpoint)."""
        result: dict[str, Any] = {}
        for part, outs in outputs.items():
            labels = self.data[part]["label"][self.eval_idx[part]]
            n = sum(float(o["n"]) for o in outs)
            pred = np.concatenate([np.asarray(o["pred"]) for o in outs])[:len(labels)]
            result[part] = {"accuracy": sum(float(o["correct"]) for o in outs) / n,
                            "cls_loss": sum(float(o["cls_loss"]) for o in outs) / n,
                            "lm_loss": sum(float(o["lm_loss"]) for o in outs) / n,
                            "per_class": {int(k): float(np.mean(pred[labels == k] == k)) for k in np.unique(labels)}}
        val, tr = result["val"], result["train"]
        return {**result, "val_accuracy": val["accuracy"], "val_cls_loss": val["cls_loss"],
                "val_lm_loss": val["lm_loss"], "train_accuracy": tr["accuracy"], "majority_baseline": self.baseline,
                "val_loss": val["cls_loss"], "labels": self.names}

    def describe(self) -> str:
        return self._description

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        val, tr = metrics["val"], metrics["train"]
        return (f"step {step}: held-out accuracy {val['accuracy']:.3f} (majority baseline {self.baseline:.3f}), "
                f"val cls loss {val['cls_loss']:.4f}, val LM loss {val['lm_loss']:.4f}; train accuracy "
                f"{tr['accuracy']:.3f}")

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        per_class = ", ".join(f"{self.names[k]}: {a:.2f}" for k, a in metrics["val"]["per_class"].items())
        return (f"done: held-out accuracy {metrics['val_accuracy']:.3f} vs majority baseline {self.baseline:.3f} on "
                f"{len(self.eval_idx['val'])} examples (per class: {per_class}); classifier saved in "
                f"{self.cfg.workdir}")


# ----------------------------------------------------------------------------------------------------
# Prediction


@dataclasses.dataclass(frozen=True, eq=False)
class Classifier:
    """A loaded classifier: `predict(texts)` returns labels as they were given in the training data."""

    params: Any
    model: GPTClassifier
    tokenizer: Tokenizer
    labels: list[Label]
    width: int

    @functools.cached_property
    def _cls_logits(self) -> Callable[[Any, np.ndarray, np.ndarray], jax.Array]:
        return jax.jit(lambda p, x, m: self.model.apply({"params": p}, x, m)[1])

    def logits(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Class logits (N, K), in batches of one fixed shape (one compilation)."""
        x, mask = encode_texts(texts, self.tokenizer, self.model.cls_token_id, self.width, "texts")
        out = []
        for idx, n_real in fixed_batches(np.arange(len(x)), batch_size):
            out.append(np.asarray(self._cls_logits(self.params, x[idx], mask[idx]))[:n_real])
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), np.float32)

    def predict(self, texts: Sequence[str], batch_size: int = 64) -> list[Label]:
        return [self.labels[k] for k in self.logits(texts, batch_size).argmax(-1)]


def load_classifier(workdir: str | Path, which: str = "latest", bpe_file: str | None = None) -> Classifier:
    """The classifier trained in `workdir` (its latest, or best by validation loss, checkpoint)."""
    loaded = weights.load(f"workdir:{workdir}", which=which)
    if "classifier" not in loaded.meta:
        raise UserError(f"{workdir} holds a language model, not a classifier: fine-tune it with "
                        "python train.py --config configs/classify_stdlib.py")
    info = loaded.meta["classifier"]
    model = GPTClassifier(loaded.model, n_class=info["n_class"], cls_token_id=info["cls_token_id"],
                          cls_dropout=info["cls_dropout"])
    return Classifier(loaded.params, model, tokenizer_from_meta(loaded.tokenizer_meta, bpe_file), info["labels"],
                      info["max_len"])


def predict(workdir: str | Path, texts: Sequence[str], which: str = "latest") -> list[Label]:
    """Labels of `texts` from the classifier saved in `workdir`."""
    return load_classifier(workdir, which).predict(texts)
