"""DPO: preference tuning on pairs of a chosen and a rejected reply to the same prompt, after SFT, on the one loop.

Each step takes batch_size pairs (`jaxgpt.data.preferences`: TRL's JSONL format or the built-in pairs), runs the
model once on both replies of every pair (2 x batch_size rows, the prompt's tokens carry no loss) and takes the
loss `config.dpo.loss_type` of their log-probabilities (`loss`: sigmoid, ipo, hinge, simpo, orpo). The model runs
without dropout, as TRL trains preferences. The losses that compare with a reference take the starting model's
log-probabilities of each pair: with `config.dpo.reference` "precomputed" (the default) they are computed once, from
init_from's weights before the first step, and written to the work directory (reference_logps.npz), so a resumed run
reads them instead of computing them and no reference model is held while training; "live" holds the reference and
runs it on each batch's rows (the same numbers, at the cost of a second model and its forward passes).

The model, its chat tokenizer and template come from init_from (a chat run, e.g. runs/chat_sft, or any source SFT
takes: a base model's vocabulary grows by the chat tokens as for SFT), and the run is saved as a chat run is, so
`sample.py --chat`, `jaxgpt serve` and `jaxgpt hf export` take it as any chat run. Step metrics are the loss and
TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen and logps/rejected (ORPO
adds nll_loss, log_odds_ratio and log_odds_chosen); evaluations report the same on held-out pairs (val_loss is their
mean loss) and the held-out exact match of the chosen replies, whether greedy decoding writes the chosen reply
(token for token by argmax, as SFT's exact match), overall and per built-in dataset.

    python train.py --config configs/chat_dpo.py [--config.dpo.data=pairs.jsonl --config.dpo.loss_type=ipo ...]
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt import storage
from jaxgpt.data.batches import batch_indices, fixed_batches, process_share, rows_sha256, spread_indices
from jaxgpt.data.conversations import TEMPLATE_FILE, by_kind_text, mean_by_kind
from jaxgpt.data.hub import HUB_SPEC
from jaxgpt.data.model_chat import chat_format
from jaxgpt.data.preferences import (
    REFERENCE_FREE_LOSSES,
    Pair,
    PreferenceConfig,
    builtin_pairs,
    encode_pair,
    hub_pairs,
    load_pairs,
    split_pairs,
)
from jaxgpt.errors import UserError
from jaxgpt.model.config import comma_names
from jaxgpt.model.gpt import GPT, dummy_tokens
from jaxgpt.tasks.chat import Chat, chat_architecture
from jaxgpt.tasks.dpo.loss import pair_losses, reply_logps, summary
from jaxgpt.tasks.dpo.rejected import (
    REJECTED_FILE,
    rejections_file,
    sample_rejections,
    saved_rejections,
    with_rejections,
)
from jaxgpt.tasks.rl.rollouts import token_rows
from jaxgpt.tasks.rl.task import local_weights, on_one_device
from jaxgpt.train.config import TrainConfig, base_config
from jaxgpt.train.resume import changed_keys

REFERENCE_FILE = "reference_logps.npz"  # in the work directory: the starting model's log-probabilities of each pair
SIDES = ("chosen", "rejected")
ROW_KEYS = tuple(f"{side}_{k}" for side in SIDES for k in ("x", "y", "mask"))


def configured_pairs(d: PreferenceConfig, seed: int) -> tuple[list[Pair], str]:
    """(pairs, a description) of config.dpo's data."""
    if d.data == "builtin":
        datasets = comma_names(d.datasets)
        return (builtin_pairs(seed, d.examples, datasets),
                f"built-in pairs: {d.examples} of {', '.join(datasets)} (seed {seed}; rejected: a corrupted answer)")
    if d.data.startswith("hf:") or d.data.endswith(".jsonl"):
        pairs = hub_pairs(d.data) if d.data.startswith("hf:") else load_pairs(d.data)
        return pairs, f"{len(pairs)} pairs from {d.data}"
    raise UserError(f"config.dpo.data={d.data!r} is neither 'builtin' nor a .jsonl file of "
                    '{"prompt": ..., "chosen": ..., "rejected": ...} objects (TRL\'s preference format) nor a Hub '
                    f"dataset of them, {HUB_SPEC}")


class DPO:
    """Preference tuning from a chat (or base) run: pairs, reference log-probabilities, the preference losses."""

    def __init__(self, cfg: TrainConfig) -> None:
        if not cfg.init_from:
            raise UserError("config.init_from is empty: DPO starts from a model, e.g. "
                            "--config.init_from=workdir:runs/chat_sft")
        if cfg.loss_chunk or cfg.label_smoothing:
            raise UserError("config.loss_chunk and config.label_smoothing are the cross-entropy's: set them to 0 for "
                            "task dpo (its own label smoothing is config.dpo.label_smoothing)")
        d = cfg.dpo
        self.cfg, self.dpo = cfg, d
        pairs, description = configured_pairs(d, cfg.seed)
        self.base_cfg, self.tokenizer, self.model_cfg = chat_architecture(cfg, "to write pairs with")
        self.model = GPT(self.model_cfg)
        self.tokenizer_meta = self.tokenizer.to_meta()
        self.chat = chat_format(self.tokenizer)  # jaxgpt's chat format or the model's own template
        self.run_files = {TEMPLATE_FILE: self.chat["template"]}  # written into the work directory when the run starts
        if d.rejected == "sampled":
            pairs, description = self._sampled(pairs, description)
        limit = self.model_cfg.block_size + 1
        self.pairs = pairs
        parts = dict(zip(("train", "val"), split_pairs(pairs, d.val_fraction), strict=True))
        encoded = {split: [encode_pair(self.tokenizer, p, limit, d.max_prompt_length, d.truncation_mode)
                           for p in items] for split, items in parts.items()}
        self.width = max(len(e.prompt) + max(len(e.chosen), len(e.rejected)) for es in encoded.values()
                         for e in es) - 1
        self.data = {split: {f"{side}_{k}": v for side in SIDES for k, v in token_rows(
            [e.prompt for e in es], [getattr(e, side) for e in es], self.width).items()}
            for split, es in encoded.items()}
        self.kinds = {split: np.array([p.kind for p in items]) for split, items in parts.items()}
        self.uses_reference = d.loss_type not in REFERENCE_FREE_LOSSES
        self.batch_ndims = {**dict.fromkeys(ROW_KEYS, 2),
                            **(dict.fromkeys(("ref_chosen", "ref_rejected"), 1) if self.uses_reference else {})}
        n_train, n_val = len(parts["train"]), len(parts["val"])
        self.eval_idx = spread_indices(n_val, cfg.eval_batches * cfg.batch_size)
        self.tokens_per_row = 2 * self.width  # a row of the batch is a pair: two sequences
        self.eval_rows_per_batch = cfg.batch_size
        self.options = {"loss_type": d.loss_type, "beta": d.beta, "label_smoothing": d.label_smoothing,
                        "simpo_gamma": d.simpo_gamma, "orpo_lambda": d.orpo_lambda, "rpo_alpha": d.rpo_alpha}
        self.settings = cfg.settings.get("dpo", {})  # what decides the updates: a resume with others is refused
        self.sha256 = {split: rows_sha256(rows, ROW_KEYS) for split, rows in self.data.items()}
        cut = sum(e.cut for es in encoded.values() for e in es)
        self._description = (
            f"{description}: {n_train} training / {n_val} held-out pairs, rows of {self.width} tokens ({cut} pairs "
            f"cut to model.block_size={limit - 1}, prompt first: truncation_mode {d.truncation_mode}, "
            f"max_prompt_length {d.max_prompt_length or 'none'})\nloss {d.loss_type}, beta {d.beta}; reference: "
            + ("none (reference-free)" if not self.uses_reference else
               f"{d.reference} (the starting model's log-probabilities)"))
        self.meta = {"chat": {**self.chat, "init_from": cfg.init_from, "data": description},
                     "dpo": {"settings": self.settings, "n_train": n_train, "n_val": n_val,
                             "train_sha256": self.sha256["train"]}}
        self._logps_program = jax.jit(lambda p, rows: jnp.stack(
            [self._logps(p, rows, side)[0] for side in SIDES], axis=1))
        self._reference: dict[str, np.ndarray] | None = None  # precomputed: {split: (N, 2)}
        self._reference_kept = False  # whether they are in the work directory
        self._reference_params: Any = None  # live: the starting model's weights on one device

    # ------------------------------------------------------------------------------------------ the loop's task

    def example_inputs(self) -> tuple[jax.Array]:
        return (dummy_tokens(self.model_cfg),)

    def _logps(self, params: Any, batch: dict[str, jax.Array], side: str) -> tuple[jax.Array, jax.Array]:
        """(each row's summed log-probability of its `side` reply, its number of tokens)."""
        logits_BWV = self.model.apply({"params": params}, batch[f"{side}_x"])
        return reply_logps(logits_BWV, batch[f"{side}_y"], batch[f"{side}_mask"]), batch[f"{side}_mask"].sum(-1)

    def _pairs(self, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`pair_losses` of the batch: the model runs once on the chosen and rejected rows together."""
        both = {f"both_{k}": jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
                for k in ("x", "y", "mask")}
        logps_2B, n_2B = self._logps(params, both, "both")
        B = batch["chosen_x"].shape[0]
        refs = (batch["ref_chosen"], batch["ref_rejected"]) if self.uses_reference else (None, None)
        return pair_losses(logps_2B[:B], logps_2B[B:], n_2B[:B], n_2B[B:], *refs, **self.options)

    def loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict]:
        loss_B, per_pair = self._pairs(params, batch)
        return jnp.mean(loss_B), summary(per_pair)

    def evaluate(self, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Each pair's loss and metrics, and whether argmax writes its chosen reply token for token."""
        loss_B, per_pair = self._pairs(params, batch)
        logits_BWV = self.model.apply({"params": params}, batch["chosen_x"])
        right_BW = (jnp.argmax(logits_BWV, -1) == batch["chosen_y"]) | (batch["chosen_mask"] == 0)
        return {"loss": loss_B, **per_pair, "exact": jnp.all(right_BW, axis=1)}

    def pretrained(self) -> Any:
        """init_from's weights (the vocabulary grown as SFT grows it); with a precomputed reference, the reference
        log-probabilities of every pair are computed from them now, before the first step."""
        params = Chat.pretrained(self)
        if self.uses_reference and self.dpo.reference == "precomputed" and self._reference is None:
            self._reference = self._score_all(params)
        return params

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        Chat.check_resume(self, saved_meta, workdir)  # the same model and tokenizer
        saved = saved_meta.get("dpo", {})
        changed = changed_keys(saved.get("settings", {}), self.settings, base_config().dpo.to_dict())
        if saved.get("train_sha256") != self.sha256["train"]:
            changed.append("the training pairs")
        if changed and not self.cfg.resume_changes:
            raise UserError(f"resuming {workdir} with other config.dpo settings ({', '.join(changed)}): pass "
                            "--config.resume_changes=True to continue with them anyway, or use a new --config.workdir")

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        idx = batch_indices(self.cfg.seed, step, len(self.data["train"]["chosen_x"]), self.cfg.batch_size)
        idx = idx[process_share(self.cfg.batch_size, process_index, process_count)]
        return self._with_reference("train", idx)

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        """Fixed batches of the held-out pairs (the last completed by repeated rows, cut off in `summarize`)."""
        part = process_share(self.cfg.batch_size, process_index, process_count)
        return {"val": [{k: v[part] for k, v in self._with_reference("val", picked).items()}
                        for picked, _ in fixed_batches(self.eval_idx, self.cfg.batch_size)]}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Held-out pairs: the mean loss (val_loss), TRL's metrics, and exact match of the chosen replies, overall
        and per kind of pair (the built-in datasets)."""
        n = len(self.eval_idx)
        per_pair = {k: np.concatenate([np.asarray(o[k]) for o in outputs["val"]])[:n] for k in outputs["val"][0]}
        exact, kinds = per_pair.pop("exact"), self.kinds["val"][self.eval_idx]
        return {"val_loss": float(per_pair.pop("loss").mean()),
                **{f"val_{k}": float(v) for k, v in summary(per_pair).items()},
                "val_exact_match": float(exact.mean()), "val_pairs": n,
                "val_exact_match_by_dataset": mean_by_kind(kinds, exact),
                "val_rewards/accuracies_by_dataset": mean_by_kind(kinds, per_pair["rewards/accuracies"])}

    def describe(self) -> str:
        return self._description

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        by_dataset = by_kind_text(metrics["val_exact_match_by_dataset"])
        return (f"step {step}: held-out loss {metrics['val_loss']:.4f}, reward accuracy "
                f"{metrics['val_rewards/accuracies']:.3f}, margin {metrics['val_rewards/margins']:.3f} (chosen "
                f"{metrics['val_rewards/chosen']:.3f}, rejected {metrics['val_rewards/rejected']:.3f}); exact match "
                f"{metrics['val_exact_match']:.3f} ({by_dataset}; {metrics['val_pairs']} held-out pairs)")

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return (f"done: held-out reward accuracy {metrics['val_rewards/accuracies']:.3f}, exact match "
                f"{metrics['val_exact_match']:.3f}; chat template in {self.cfg.workdir}/{TEMPLATE_FILE}")

    def _sampled(self, pairs: list[Pair], description: str) -> tuple[list[Pair], str]:
        """The pairs with the starting model's own wrong replies as rejected (`rejected`): read back from the work
        directory, else sampled now (kept there when the run starts, as a run file)."""
        rejected = saved_rejections(self.cfg.workdir, len(pairs))
        if rejected is None:
            with on_one_device():
                rejected = sample_rejections(pairs, local_weights(Chat.pretrained(self)), self.model_cfg,
                                             self.tokenizer, self.chat["end_id"], self.cfg.seed, 64)
        self.run_files[REJECTED_FILE] = rejections_file(rejected)
        own = sum(r != p.rejected for p, r in zip(pairs, rejected, strict=True))
        return with_rejections(pairs, rejected), description.replace(
            "rejected: a corrupted answer", f"rejected: the model's own wrong reply for {own}, a corrupted answer "
            f"for {len(pairs) - own} it answered right")

    # ------------------------------------------------------------------------------------------ the reference

    def _with_reference(self, split: str, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `idx` of `split`, with the reference's log-probabilities of their replies when the loss takes them."""
        rows = {k: v[idx] for k, v in self.data[split].items()}
        if not self.uses_reference:
            return rows
        if self.dpo.reference == "live":
            if self._reference_params is None:
                self._reference_params = local_weights(Chat.pretrained(self))
            ref = self._score(self._reference_params, rows)
        else:
            ref = self._precomputed()[split][idx]
        return {**rows, "ref_chosen": ref[:, 0], "ref_rejected": ref[:, 1]}

    def _score(self, params: Any, rows: dict[str, np.ndarray]) -> np.ndarray:
        """(N, 2): the chosen and rejected replies' log-probabilities under `params`, in batches of one shape."""
        out = []
        with on_one_device():
            for picked, n_real in fixed_batches(np.arange(len(rows["chosen_x"])), self.cfg.batch_size):
                out.append(np.asarray(self._logps_program(params, {k: rows[k][picked] for k in ROW_KEYS}))[:n_real])
        return np.concatenate(out).astype(np.float32)

    def _score_all(self, params: Any) -> dict[str, np.ndarray]:
        local = local_weights(params)
        return {split: self._score(local, rows) for split, rows in self.data.items()}

    def _precomputed(self) -> dict[str, np.ndarray]:
        """The reference log-probabilities of every pair: computed by `pretrained` (a fresh run), else read back
        from the work directory (a resumed run), else (the file lost) computed again from init_from. Written to the
        work directory by the first process when it does not hold them yet."""
        if self._reference_kept:
            return self._reference
        path = storage.location(self.cfg.workdir, "config.workdir") / REFERENCE_FILE
        digest = hashlib.sha256("".join(self.sha256.values()).encode()).hexdigest()
        with storage.guard(path, "reading the reference log-probabilities from"):
            if path.exists():
                with np.load(io.BytesIO(path.read_bytes())) as saved:
                    if str(saved["rows_sha256"]) == digest:
                        self._reference, self._reference_kept = {split: saved[split] for split in self.data}, True
                        return self._reference
        if self._reference is None:
            self._reference = self._score_all(Chat.pretrained(self))
        if jax.process_index() == 0:
            buffer = io.BytesIO()
            np.savez(buffer, rows_sha256=digest, **self._reference)
            with storage.guard(path, "writing the reference log-probabilities to"):
                path.parent.mkdir(parents=True, exist_ok=True)
                storage.write_bytes(path, buffer.getvalue())
        self._reference_kept = True
        return self._reference
