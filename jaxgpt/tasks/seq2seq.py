"""Task seq2seq: the seq2seq model (`jaxgpt.model.encdec`, an encoder-decoder) trained on source/target pairs.

Teacher forcing: the decoder reads [bos] + target and is trained to predict target + [eos] at every position
at once; the loss is the mean cross-entropy over real target tokens (padding and the filler rows of a short
evaluation batch count nothing), with the targets optionally smoothed toward uniform (`label_smoothing`,
0.1 in "Attention is all you need"). Evaluation reports the plain loss, token accuracy under teacher forcing,
and exact match: the fraction of held-out sources whose greedy decoding (`seq2seq_decoding.greedy`, the
model feeding back its own tokens, not teacher-forced argmax) is exactly the target. It trains on the one
loop:

    python train.py --config configs/seq2seq_copy.py [--config.seq2seq.data=pairs.tsv ...]

Data, vocabulary and batches: `jaxgpt.data.pairs`. The row widths come from the data: the longest source,
and the longest target + 1, of the pairs that fit `model.block_size` (longer pairs are skipped and counted).
"""

from __future__ import annotations

import shlex
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.data.batches import filler_batches, process_share, rows_sha256, spread_indices, step_rows
from jaxgpt.data.pairs import (
    SPECIALS,
    Pair,
    build_tokenizer,
    decode_ids,
    encode_pairs,
    fitting,
    load_pairs,
    to_ids,
)
from jaxgpt.errors import UserError
from jaxgpt.generate.seq2seq import greedy
from jaxgpt.io import weights
from jaxgpt.model.config import Seq2SeqConfig
from jaxgpt.model.encdec import Seq2SeqModel, dummy_batch
from jaxgpt.ops.loss import masked_mean, token_cross_entropy
from jaxgpt.train.config import TrainConfig

Batch = dict[str, jax.Array]  # src (B, S), tgt_in / tgt_out (B, T) int32, weight (B,) float32


def seq2seq_loss(logits_BTV: jax.Array, batch: Batch, label_smoothing: float = 0.0) -> jax.Array:
    """Mean (smoothed) cross-entropy over the real target tokens of the real rows."""
    mask_BT = (batch["tgt_out"] != SPECIALS["pad_id"]) * batch["weight"][:, None]
    tok_BT = token_cross_entropy(logits_BTV, batch["tgt_out"], label_smoothing)
    return masked_mean(tok_BT, mask_BT)



class Seq2Seq:
    """The encoder-decoder on source/target pairs, on the loop: data, model, loss, greedy evaluation."""

    batch_ndims: ClassVar[dict[str, int]] = {"src": 2, "tgt_in": 2, "tgt_out": 2, "weight": 1}

    def __init__(self, cfg: TrainConfig) -> None:
        s = cfg.seq2seq
        if cfg.init_from:
            raise UserError("config.init_from is not available for task seq2seq (the encoder-decoder trains from "
                            "scratch): set it to ''")
        if cfg.model.pad_id not in (None, SPECIALS["pad_id"]):
            raise UserError(f"config.model.pad_id={cfg.model.pad_id}: task seq2seq pads with id "
                            f"{SPECIALS['pad_id']}; leave it unset")
        train, val, description = load_pairs(s.data, s.val_fraction, s.examples, s.symbols, s.length)
        tokenizer = build_tokenizer(s.tokenizer, [t for pair in train + val for t in pair], s.word_vocab)
        vocab = tokenizer.vocab_size + SPECIALS["offset"]
        if not cfg.vocab_from_data and cfg.model.vocab_size < vocab:
            raise UserError(f"config.model.vocab_size={cfg.model.vocab_size} is smaller than the pairs' vocabulary "
                            f"({vocab} with the specials): raise it or leave it unset")
        limit = cfg.model.block_size
        ids = {"train": to_ids(train, tokenizer), "val": to_ids(val, tokenizer)}
        train_kept, src_tr, tgt_tr = fitting(ids["train"], limit, limit)
        val_kept, src_val, tgt_val = fitting(ids["val"], limit, limit)
        if not train_kept or not val_kept:
            raise UserError(f"no {'training' if not train_kept else 'held-out'} pair fits model.block_size={limit} "
                            "tokens (target + 1 for eos): raise config.model.block_size")
        src_len, tgt_len = max(src_tr, src_val), max(tgt_tr, tgt_val)
        self.model_cfg = Seq2SeqConfig(
            cfg.model.replace(vocab_size=vocab if cfg.vocab_from_data else cfg.model.vocab_size, block_size=tgt_len,
                              pad_id=SPECIALS["pad_id"]),
            n_encoder_layer=s.n_encoder_layer, src_block_size=src_len, share_embeddings=s.share_embeddings)
        self.cfg, self.tokenizer, self.val_pairs = cfg, tokenizer, [val[i] for i in val_kept]
        self.data = {split: encode_pairs([ids[split][i] for i in kept], src_len, tgt_len)
                     for split, kept in (("train", train_kept), ("val", val_kept))}
        self.model = Seq2SeqModel(self.model_cfg)
        self.tokenizer_meta = tokenizer.to_meta()
        self.tokens_per_row = src_len + tgt_len
        self.eval_rows_per_batch = cfg.batch_size
        self._dropout = cfg.model.any_dropout
        # at most eval_batches of rows spread evenly over each split (all of it if fewer)
        self.eval_idx = {split: spread_indices(len(part["src"]), cfg.eval_batches * cfg.batch_size)
                         for split, part in self.data.items()}
        skipped = len(train) + len(val) - len(train_kept) - len(val_kept)
        self._description = (f"{description}\n{tokenizer.name} vocabulary of {tokenizer.vocab_size} tokens + "
                             f"{SPECIALS['offset']} specials; rows of {src_len} source / {tgt_len} target tokens"
                             + (f"; {skipped} pairs longer than model.block_size={limit} skipped" if skipped else ""))
        self.meta = {"seq2seq": dict(SPECIALS), "dataset": {
            "description": description, "tokenizer": self.tokenizer_meta, "vocab_size": vocab,
            "n_train": len(train_kept), "n_val": len(val_kept),
            **{f"{split}_sha256": rows_sha256(self.data[split], ("src", "tgt_out")) for split in ("train", "val")}}}

    def example_inputs(self) -> tuple[jax.Array, jax.Array]:
        return dummy_batch(self.model_cfg)

    def _logits(self, params: Any, batch: Batch, key: jax.Array | None) -> jax.Array:
        dropout = self._dropout and key is not None
        return self.model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=not dropout,
                                rngs={"dropout": key} if dropout else None)

    def loss(self, params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]:
        return seq2seq_loss(self._logits(params, batch, key), batch, self.cfg.label_smoothing), {}

    def evaluate(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        """Sums over the batch's real tokens and rows (so batches combine exactly) and the greedy decodings."""
        logits_BTV = self._logits(params, batch, None)
        w_B = batch["weight"]
        mask_BT = (batch["tgt_out"] != SPECIALS["pad_id"]) * w_B[:, None]
        n_tokens = jnp.sum(mask_BT)
        decoded_BT = greedy(params, self.model_cfg, batch["src"], bos_id=SPECIALS["bos_id"],
                            eos_id=SPECIALS["eos_id"], max_new_tokens=self.model_cfg.model.block_size)
        return {"n_tokens": n_tokens, "n_rows": jnp.sum(w_B),
                "loss": seq2seq_loss(logits_BTV, batch) * n_tokens,
                "correct": jnp.sum((jnp.argmax(logits_BTV, -1) == batch["tgt_out"]) * mask_BT),
                "exact": jnp.sum(jnp.all(decoded_BT == batch["tgt_out"], axis=1) * w_B),
                "decoded": decoded_BT}

    def pretrained(self) -> None:
        return None

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        weights.require_same_run(saved_meta, self.model_cfg, workdir, "use the same config and data",
                                 vocabulary=(saved_meta.get("tokenizer"), self.tokenizer_meta))

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        return step_rows(self.data["train"], self.cfg.seed, step, self.cfg.batch_size, process_index, process_count)

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        share = process_share(self.cfg.batch_size, process_index, process_count)
        return {split: filler_batches(self.data[split], idx, self.cfg.batch_size, ("weight",), share)
                for split, idx in self.eval_idx.items()}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Per split: loss (plain cross-entropy, the best-checkpoint metric for val), token accuracy, exact
        match; and the first held-out source with its greedy decoding, to see what the model does."""
        result: dict[str, Any] = {}
        for split, outs in outputs.items():
            total = lambda key, outs=outs: sum(float(o[key]) for o in outs)
            result[f"{split}_loss"] = total("loss") / total("n_tokens")
            result[f"{split}_token_accuracy"] = total("correct") / total("n_tokens")
            result[f"{split}_exact_match"] = total("exact") / total("n_rows")
            result[f"{split}_pairs"] = int(total("n_rows"))
        first = self._example(self.val_pairs[0], outputs["val"][0]["decoded"][0])
        return {**result, "example": first}

    def _example(self, pair: Pair, decoded: np.ndarray) -> str:
        return f"{pair[0]!r} -> {decode_ids(self.tokenizer, SPECIALS, decoded)!r} (target {pair[1]!r})"

    def describe(self) -> str:
        return self._description

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        return (f"step {step}: val loss {metrics['val_loss']:.4f}, token accuracy {metrics['val_token_accuracy']:.3f}, "
                f"exact match {metrics['val_exact_match']:.3f} (greedy, {metrics['val_pairs']} held-out pairs); "
                f"train loss {metrics['train_loss']:.4f}, exact match {metrics['train_exact_match']:.3f}; "
                f"e.g. {metrics['example']}")

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return (f"done: held-out exact match {metrics['val_exact_match']:.3f} by greedy decoding on "
                f"{metrics['val_pairs']} pairs (token accuracy {metrics['val_token_accuracy']:.3f}); translate with "
                f"python sample.py --workdir {self.cfg.workdir} --source {shlex.quote(self.val_pairs[0][0])}")
