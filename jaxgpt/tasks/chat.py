"""Chat: supervised fine-tuning (SFT) of a language model on conversations, on the one loop.

The model and base tokenizer come from `init_from` (any source of `jaxgpt.io.weights`: a jaxgpt run, Hugging Face
weights, a GGUF file or a preset). A model with its own chat template (Llama, Qwen, Gemma, SmolLM2 and kin) is tuned
in that template (`chat_architecture`); any other gets the chat format's special tokens added to its tokenizer
(`jaxgpt.data.conversations`), and when they do not fit the model's vocabulary its token table (and untied head)
grows by their rows, started at the mean of the existing rows plus noise of their spread, so the new tokens begin
as typical tokens rather than as outliers.

Rows are as wide as the longest conversation that fits `model.block_size` (longer ones are cut after their last
assistant turn that fits, or dropped; both counted). By default a training row holds one conversation,
right-padded: padding comes after it, so causal attention keeps it unseen. With `config.chat.pack` the training
conversations are packed into rows (`pack_rows`: best-fit decreasing, fixed by the data, so the batch of every
step is still a pure function of (seed, step)) and each token's segment id keeps them apart: a token sees only
its own conversation and positions restart at each one (`GPT.hidden`'s document mask). The run's description
gives both layouts' rows, conversations per row and padding. Evaluation (held-out and train) keeps one
conversation per row either way, since exact match is per row. The loss is the mean cross-entropy over the
assistant's tokens and their end tokens only.

Evaluation reports the loss on held-out conversations and exact match: the fraction whose last assistant turn is
predicted token for token (end token included) by argmax given the conversation before it. That is exactly
whether greedy decoding from the prompt writes the reference answer and stops, without a decoding loop. It
trains on the one loop:

    python train.py --config configs/chat_sft.py [--config.chat.data=conversations.jsonl ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.data.batches import filler_batches, process_share, rows_sha256, spread_indices, step_rows
from jaxgpt.data.conversations import (
    TEMPLATE_FILE,
    Conversation,
    Conversations,
    Encoded,
    builtin_conversations,
    by_kind_text,
    chat_tokenizer,
    fit_context,
    load_hub,
    load_jsonl,
    mean_by_kind,
    pack_rows,
    split_held_out,
    to_rows,
)
from jaxgpt.data.hub import HUB_SPEC
from jaxgpt.data.model_chat import ModelChat, chat_format, describe_format, encode_chat
from jaxgpt.data.tokenizer import Tokenizer, WithSpecialTokens, tokenizer_from_meta
from jaxgpt.data.tokenizer_json import JsonTokenizer
from jaxgpt.errors import UserError
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig, comma_names
from jaxgpt.model.gpt import GPT, check_segments, dummy_tokens
from jaxgpt.ops.loss import masked_mean, token_cross_entropy
from jaxgpt.train.config import ChatConfig, TrainConfig, base_config

# x, y (B, W) int32; loss_mask, answer_mask (B, W) float32 over the targets y; segments (B, W) int32 of the inputs
# when rows are packed (config.chat.pack)
Batch = dict[str, jax.Array]


def chat_loss(logits_BWV: jax.Array, batch: Batch, label_smoothing: float = 0.0) -> jax.Array:
    """Mean (smoothed) cross-entropy over the assistant's target tokens; everything else counts nothing."""
    mask_BW = batch["loss_mask"]
    tok_BW = token_cross_entropy(logits_BWV, batch["y"], label_smoothing)
    return masked_mean(tok_BW, mask_BW)


def configured_conversations(c: Conversations, seed: int) -> tuple[list[Conversation], list[str], list[str], str]:
    """(conversations, where each comes from, its kind (its built-in dataset) for per-dataset accuracy, a
    description) of config.chat, or of config.rl for RL's prompts."""
    if c.data == "builtin":
        datasets = comma_names(c.datasets)
        conversations = builtin_conversations(seed, c.examples, datasets)
        kinds = [datasets[i % len(datasets)] for i in range(len(conversations))]
        return (conversations, [f"built-in conversation {i}" for i in range(len(conversations))], kinds,
                f"built-in conversations: {c.examples} of {', '.join(datasets)} (seed {seed})")
    if c.data.startswith("hf:"):
        numbered = load_hub(c.data, f"config.{c.group}.data")
        origins = [f"{c.data} row {n}" for n, _ in numbered]
    elif c.data.endswith(".jsonl"):
        numbered = load_jsonl(c.data)
        origins = [where for where, _ in numbered]
    else:
        raise UserError(f"config.{c.group}.data={c.data!r} is neither 'builtin' nor a .jsonl file of "
                        f"{{\"messages\": [...]}} objects (OpenAI's format) nor a Hub dataset, {HUB_SPEC}")
    return ([conv for _, conv in numbered], origins, ["conversations"] * len(numbered),
            f"{len(numbered)} conversations from {c.data}")


def _layout(row_lengths: Sequence[int], width: int, n_conversations: int) -> str:
    """Rows (of `width` inputs, the ids of each row but its last), conversations per row and the fraction of
    inputs that are padding, for the description."""
    n = len(row_lengths)
    padding = 1 - sum(min(length, width) for length in row_lengths) / (n * width)
    return f"{n} rows, {n_conversations / n:.2f} conversations per row, {padding:.1%} padding"


Fitted = tuple[Encoded, str, Conversation]  # a conversation's ids as they fit the context, its kind, its messages


def _fit(conversations: list[Conversation], origins: list[str], kinds: list[str], tokenizer: Tokenizer,
         block_size: int) -> tuple[list[Fitted], int, int]:
    """The conversations encoded, each cut after its last assistant turn that fits a row of `block_size` inputs or
    dropped: (those kept, how many were cut, how many dropped). One that cannot be encoded is a UserError naming
    its origin, and so is none fitting."""
    limit = block_size + 1  # a row's inputs are all ids but the last
    kept: list[Fitted] = []
    cut = dropped = 0
    for messages, origin, kind in zip(conversations, origins, kinds, strict=True):
        try:
            encoded = encode_chat(tokenizer, messages)
        except UserError as e:
            raise UserError(f"{origin}: {e}") from None
        fitted = fit_context(encoded, limit)
        cut += fitted is not None and fitted is not encoded
        dropped += fitted is None
        if fitted is not None:
            kept.append((fitted, kind, messages))
    if not kept:
        raise UserError(f"no conversation's first assistant turn fits model.block_size={block_size} tokens: raise "
                        "config.model.block_size (up to the weights' context)")
    return kept, cut, dropped


def _split(kept: list[Fitted], val_fraction: float) -> dict[str, list[Fitted]]:
    """{"train", "val" (held out)} of the conversations that fit the context, by `split_held_out` of their messages:
    the one split of the trainer and of `held_out_conversations`, made after those too long are dropped, so both
    hold out the same conversations and agree on whether there are enough to hold some out."""
    held = {id(m) for m in split_held_out([m for _, _, m in kept], val_fraction)[1]}
    return {"train": [f for f in kept if id(f[2]) not in held], "val": [f for f in kept if id(f[2]) in held]}


def _through_turn(messages: Conversation, n: int) -> Conversation:
    """`messages` up to and including their `n`-th assistant turn (what `fit_context` keeps of them)."""
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    return messages[:ends[n - 1]]


def held_out_conversations(c: ChatConfig, seed: int, tokenizer: Tokenizer,
                           block_size: int) -> list[tuple[Conversation, str]]:
    """The held-out conversations a chat run of config.chat scores, as it scores them, each with its kind (its
    built-in dataset): those that fit its context (`tokenizer` and `block_size`: the run's), each up to its last
    assistant turn that fits. For measuring a trained run elsewhere (through the server: benchmarks/bench_chat.py)."""
    conversations, origins, kinds, _ = configured_conversations(c, seed)
    kept, _, _ = _fit(conversations, origins, kinds, tokenizer, block_size)
    return [(_through_turn(m, len(e.turn_ends)), kind) for e, kind, m in _split(kept, c.val_fraction)["val"]]


def chat_architecture(cfg: TrainConfig, purpose: str
                      ) -> tuple[ModelConfig, WithSpecialTokens | ModelChat, ModelConfig]:
    """(init_from's architecture, its chat tokenizer, that architecture with the vocabulary grown to hold the
    tokenizer): what a chat fine-tune (SFT, RL) trains. The chat tokenizer is the model's own with its chat template
    when it has one (`ModelChat`: a Hugging Face directory's, a GGUF file's, a run fine-tuned from one; nothing
    grows), else its tokenizer with jaxgpt's chat tokens. `purpose` completes the error for a tokenizer-less source."""
    base_cfg, tokenizer_meta = weights.fit_architecture(cfg.init_from, cfg.model, base_config().model.to_dict(),
                                                        cfg.vocab_from_data)
    if tokenizer_meta is None:
        raise UserError(f"init_from {cfg.init_from} has no known tokenizer {purpose}: use a jaxgpt run or a Hugging "
                        "Face directory or GGUF file with its tokenizer")
    base = tokenizer_from_meta(tokenizer_meta, cfg.data.bpe_file or None)
    own = weights.describe_chat(cfg.init_from) if isinstance(base, JsonTokenizer) else None
    tokenizer = ModelChat(base, own) if own is not None else chat_tokenizer(base)
    return base_cfg, tokenizer, base_cfg.replace(vocab_size=max(base_cfg.vocab_size, tokenizer.vocab_size))


class Chat:
    """Supervised fine-tuning on conversations: data, chat tokenizer, grown vocabulary, masked loss, exact match."""

    def __init__(self, cfg: TrainConfig) -> None:
        if not cfg.init_from:
            raise UserError("config.init_from is empty: chat fine-tuning starts from a model, e.g. "
                            "--config.init_from=workdir:runs/stdlib_char (or hf:PATH, preset:NAME)")
        if cfg.loss_chunk:
            raise UserError("config.loss_chunk applies to task lm: set it to 0 for chat (rows are conversations)")
        pack = cfg.chat.pack
        conversations, origins, kinds, description = configured_conversations(cfg.chat, cfg.seed)
        self.base_cfg, tokenizer, self.model_cfg = chat_architecture(cfg, "to add the chat tokens to")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.model = GPT(self.model_cfg)
        if pack:  # an attention that would not keep packed conversations apart: one line now, not at the first step
            check_segments(self.model_cfg)
        self.tokenizer_meta = tokenizer.to_meta()
        self.run_files = {TEMPLATE_FILE: chat_format(tokenizer)["template"]}  # what sample --chat and serve render

        block_size = self.model_cfg.block_size
        kept, cut, dropped = _fit(conversations, origins, kinds, tokenizer, block_size)
        parts = _split(kept, cfg.chat.val_fraction)
        self.width = max(len(e.ids) for e, _, _ in kept) - 1
        self.batch_ndims = {"x": 2, "y": 2, "loss_mask": 2, "answer_mask": 2, **({"segments": 2} if pack else {})}
        rows = {split: to_rows([e for e, _, _ in items], self.width) for split, items in parts.items()}
        lengths = [len(e.ids) for e, _, _ in parts["train"]]
        plan = pack_rows(lengths, self.width + 1)
        keep = lambda r: {k: r[k] for k in self.batch_ndims}
        self.data = {split: keep(r) for split, r in rows.items()}  # one conversation per row: what evaluation scores
        # what training samples
        self.train = keep(to_rows([e for e, _, _ in parts["train"]], self.width, plan) if pack else rows["train"])
        self.kinds = {split: np.array([k for _, k, _ in items]) for split, items in parts.items()}
        n_train, n_val = len(parts["train"]), len(parts["val"])
        self.eval_idx = {"val": spread_indices(n_val, cfg.eval_batches * cfg.batch_size),
                         "train": spread_indices(n_train, min(n_val, cfg.eval_batches * cfg.batch_size))}
        self.tokens_per_row = self.width
        self.eval_rows_per_batch = cfg.batch_size
        self._dropout = self.model_cfg.any_dropout
        grown = self.model_cfg.vocab_size - self.base_cfg.vocab_size
        self._description = (
            f"{description}: {n_train} train / {n_val} held-out conversations, rows of {self.width} tokens; "
            f"{cut} cut at a turn boundary and {dropped} dropped (longer than model.block_size={block_size})\n"
            f"train rows, one conversation each: {_layout(lengths, self.width, n_train)}; packed: "
            f"{_layout([sum(lengths[i] for i in row) for row in plan], self.width, n_train)}"
            f" (config.chat.pack={pack}: training samples the {'packed' if pack else 'one-conversation'} rows)\n"
            f"{describe_format(tokenizer)}"
            + (f"; vocabulary grown from {self.base_cfg.vocab_size} to {self.model_cfg.vocab_size}" if grown else ""))
        self.meta = {"chat": {
            **chat_format(tokenizer), "init_from": cfg.init_from, "data": description, "n_train": n_train,
            "n_val": n_val, "cut": cut, "dropped": dropped, "pack": pack,
            "train_sha256": rows_sha256(self.train, ("x", "loss_mask", "segments") if pack else ("x", "loss_mask")),
            "val_sha256": rows_sha256(self.data["val"], ("x", "loss_mask"))}}

    def example_inputs(self) -> tuple[jax.Array]:
        return (dummy_tokens(self.model_cfg),)

    def _logits(self, params: Any, batch: Batch, key: jax.Array | None) -> jax.Array:
        """The model on the batch's inputs, with its segments when rows are packed (then in every batch)."""
        dropout = self._dropout and key is not None
        return self.model.apply({"params": params}, batch["x"], deterministic=not dropout,
                                rngs={"dropout": key} if dropout else None, segments_BT=batch.get("segments"))

    def loss(self, params: Any, batch: Batch, key: jax.Array) -> tuple[jax.Array, dict]:
        return chat_loss(self._logits(params, batch, key), batch, self.cfg.label_smoothing), {}

    def evaluate(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        """Sums over the batch's assistant tokens (so batches combine exactly) and each row's exact match."""
        logits_BWV = self._logits(params, batch, None)
        mask_BW, answer_BW = batch["loss_mask"], batch["answer_mask"]
        right_BW = jnp.argmax(logits_BWV, -1) == batch["y"]
        n_tokens = jnp.sum(mask_BW)
        return {"loss": chat_loss(logits_BWV, batch) * n_tokens, "n_tokens": n_tokens,
                "correct": jnp.sum(right_BW * mask_BW),
                "exact_B": jnp.all(right_BW | (answer_BW == 0), axis=1) & (jnp.sum(answer_BW, axis=1) > 0)}

    def pretrained(self) -> Any:
        loaded = weights.load_for(self.cfg.init_from, self.base_cfg)
        return weights.grow_vocab(jax.device_get(loaded.params), self.model_cfg.vocab_size, self.cfg.seed)

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        weights.require_same_run(saved_meta, self.model_cfg, workdir, "use the same config and init_from",
                                 tokenizer=(saved_meta.get("tokenizer"), self.tokenizer_meta))

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        return step_rows(self.train, self.cfg.seed, step, self.cfg.batch_size, process_index, process_count)

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        """Fixed batches of the sampled conversations; the last is completed by filler rows whose masks are 0."""
        share = process_share(self.cfg.batch_size, process_index, process_count)
        return {split: filler_batches(self.data[split], idx, self.cfg.batch_size, ("loss_mask", "answer_mask"), share)
                for split, idx in self.eval_idx.items()}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Per split: loss over assistant tokens (val_loss: the best-checkpoint metric), token accuracy, exact
        match, and exact match per kind of conversation (the built-in datasets)."""
        result: dict[str, Any] = {}
        for split, outs in outputs.items():
            total = lambda key, outs=outs: sum(float(o[key]) for o in outs)
            kinds = self.kinds[split][self.eval_idx[split]]
            exact = np.concatenate([np.asarray(o["exact_B"]) for o in outs])[:len(kinds)]
            result[f"{split}_loss"] = total("loss") / max(total("n_tokens"), 1.0)
            result[f"{split}_token_accuracy"] = total("correct") / max(total("n_tokens"), 1.0)
            result[f"{split}_exact_match"] = float(exact.mean())
            result[f"{split}_conversations"] = len(kinds)
            result[f"{split}_exact_match_by_dataset"] = mean_by_kind(kinds, exact)
        return result

    def describe(self) -> str:
        return self._description

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        by_dataset = by_kind_text(metrics["val_exact_match_by_dataset"])
        return (f"step {step}: val loss {metrics['val_loss']:.4f}, exact match {metrics['val_exact_match']:.3f} "
                f"({by_dataset}; {metrics['val_conversations']} held-out conversations); train loss "
                f"{metrics['train_loss']:.4f}, exact match {metrics['train_exact_match']:.3f}")

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return (f"done: held-out exact match {metrics['val_exact_match']:.3f} on {metrics['val_conversations']} "
                f"conversations (token accuracy {metrics['val_token_accuracy']:.3f}); chat template in "
                f"{self.cfg.workdir}/{TEMPLATE_FILE}")

