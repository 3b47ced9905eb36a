"""RL: reinforcement learning on rewards a program checks (GRPO), after SFT, on the one loop.

Each step samples `rl.num_generations` completions (a group) for each of batch_size / num_generations training
prompts through the serving engine (`rollouts`), scores them (`rewards`), normalizes the rewards within each
group, and takes a clipped policy-gradient step on the completion tokens only (`loss`: loss_type grpo, dr_grpo
or dapo, an optional KL penalty `beta` to the frozen starting model). The loop hands the task the weights it is
about to train (`use_weights`), so the rows of step i are a pure function of (seed, i) and those weights: a run
killed and resumed samples the same rollouts and continues bit for bit. With `num_iterations` = mu > 1 the
rollouts of step mu*g serve steps mu*g .. mu*g + mu - 1, their sampling policy's log-probabilities recorded when
they were sampled (the importance ratio's denominator); they are also written to the work directory
(rollouts/g.npz), which is what a run resumed in the middle of such a group reads back.

The model, its chat tokenizer and template come from init_from (a chat run, e.g. runs/chat_sft; a base model's
vocabulary grows by the chat tokens as for SFT), and the run saves them as a chat run does, so `sample.py --chat`,
`jaxgpt serve` and `jaxgpt hf export` take it as any chat run. Step metrics (train_*): the loss, mean reward, the
rewards' spread within a group, the share of groups with no signal (every reward equal: advantage 0), the KL to
the starting model (k3, on the completion tokens), the clip fraction, completion length, and tokens/s of the
rollouts and of the previous step's update. Evaluations sample the held-out prompts: pass@1 of the greedy
completion, pass@k and pass@1 of k sampled ones, the mean greedy reward (val_loss is its negative: the best
checkpoint is the one with the highest); and the loss of their reference answers where they have one (`evaluate`).

    python train.py --config configs/chat_rl.py [--config.rl.reward=my_rewards:brevity ...]
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxgpt import storage
from jaxgpt.data.batches import batch_indices, fixed_batches, process_share, spread_indices
from jaxgpt.data.conversations import TEMPLATE_FILE, by_kind_text
from jaxgpt.data.model_chat import chat_format
from jaxgpt.data.streams import ROLLOUT_STREAM
from jaxgpt.errors import UserError
from jaxgpt.io.checkpoint import checkpoint_dir
from jaxgpt.model.gpt import GPT, dummy_tokens
from jaxgpt.tasks.chat import Chat, chat_architecture
from jaxgpt.tasks.rl.loss import policy_loss, token_logprobs
from jaxgpt.tasks.rl.prompts import load_prompts, split_prompts
from jaxgpt.tasks.rl.rewards import EXACT, parse_rewards
from jaxgpt.tasks.rl.rollouts import (
    PromptSet,
    Sampler,
    encode_prompts,
    group_rows,
    mask_truncated,
    pass_rates,
    request_seed,
    token_rows,
)
from jaxgpt.train import renamed
from jaxgpt.train.config import TrainConfig, base_config
from jaxgpt.train.resume import changed_keys

EVAL_ONLY = ("slots", "eval_prompts", "pass_k")  # config.rl keys that leave the training trajectory alone
ROLLOUTS_DIR = "rollouts"  # in the work directory: each group's rollouts while num_iterations > 1
STAT_KEYS = ("reward", "group_spread", "no_signal", "completion_tokens", "rollout_tokens_per_sec",
             "update_tokens_per_sec")


@contextlib.contextmanager
def on_one_device() -> Iterator[None]:
    """No mesh and no activation rules: where the engine and the scoring pass run, on one device, inside the loop's
    mesh (which spans every device: its programs would refuse one-device weights)."""
    with jax.set_mesh(None), nn.logical_axis_rules(()):
        yield


def local_weights(params: Any) -> Any:
    """The weights on this process's first device, for the engine and the scoring pass (they run on one device;
    weights split over other processes are gathered first)."""
    device = jax.local_devices()[0]
    gather = lambda a: multihost_utils.process_allgather(a, tiled=True) if isinstance(a, jax.Array) and (
        not a.is_fully_addressable) else a
    return jax.device_put(jax.tree.map(gather, params), device)


class RL:
    """GRPO from a chat (or base) run: prompts, rewards, rollouts through the engine, the clipped loss, pass@k."""

    def __init__(self, cfg: TrainConfig) -> None:
        if not cfg.init_from:
            raise UserError("config.init_from is empty: RL starts from a model, e.g. "
                            "--config.init_from=workdir:runs/chat_sft")
        rl = cfg.rl
        self.cfg, self.rl = cfg, rl
        self.rewards = parse_rewards(rl.reward)
        prompts, description = load_prompts(rl, cfg.seed)
        self.base_cfg, self.tokenizer, self.model_cfg = chat_architecture(cfg, "to write prompts with")
        self.model = GPT(self.model_cfg)
        self.tokenizer_meta = self.tokenizer.to_meta()
        self.end_id = chat_format(self.tokenizer)["end_id"]
        self.run_files = {TEMPLATE_FILE: chat_format(self.tokenizer)["template"]}  # what sample --chat and serve render
        train, held = split_prompts(prompts, rl.val_fraction)
        block_size = self.model_cfg.block_size
        self.train, dropped = encode_prompts(train, self.tokenizer, block_size, rl.max_new_tokens)
        held_set, _ = encode_prompts(held, self.tokenizer, block_size, rl.max_new_tokens)
        if not self.train.prompts or not held_set.prompts:
            raise UserError(f"no training or no held-out prompt leaves room for a completion in model.block_size="
                            f"{block_size}: raise it (up to the weights' context) or shorten the prompts")
        pick = spread_indices(len(held_set.prompts), rl.eval_prompts)
        self.held = PromptSet([held_set.prompts[i] for i in pick], [held_set.ids[i] for i in pick],
                              [held_set.room[i] for i in pick])
        missing = next((p for p in self.train.prompts + self.held.prompts if p.answer is None), None)
        if missing is not None and any(r.name == EXACT for r in self.rewards):
            raise UserError(f"{missing.origin} has no answer for the built-in checker (config.rl.reward=exact): "
                            'give an "answer" field, or use your own reward (--config.rl.reward=module:function)')
        self.width = max(len(i) + r for i, r in zip(self.train.ids, self.train.room, strict=True)) - 1
        self.sampler = Sampler(self.model_cfg, self.tokenizer, self.end_id, rl, self.rewards)
        self.batch_ndims = {"x": 2, "y": 2, "mask": 2, "advantage": 1, **dict.fromkeys(STAT_KEYS, 1),
                            **({"old_logp": 2} if rl.num_iterations > 1 else {}),
                            **({"ref_logp": 2} if rl.beta > 0 else {})}
        self.tokens_per_row = self.width
        self.eval_rows_per_batch = cfg.batch_size
        self._answers = self._answer_rows()
        # what decides the updates (saved with every checkpoint; a resume with others is refused)
        self.settings = {k: v for k, v in cfg.settings.get("rl", {}).items() if k not in EVAL_ONLY}
        self._description = (
            f"{description}: {len(self.train.prompts)} training / {len(held_set.prompts)} held-out prompts "
            f"({dropped} dropped: no room for a reply in model.block_size={block_size}); "
            f"{cfg.batch_size // rl.num_generations} prompts x {rl.num_generations} completions per step, rows of "
            f"{self.width} tokens\nreward {rl.reward}; loss {rl.loss_type}, epsilon {rl.epsilon}, beta {rl.beta}, "
            f"{rl.num_iterations} update(s) per batch of rollouts; evaluations: {len(self.held.prompts)} held-out "
            f"prompts, greedy pass@1 and pass@{rl.pass_k}")
        self.meta = {"chat": {**chat_format(self.tokenizer), "init_from": cfg.init_from, "data": description},
                     "rl": {"settings": self.settings, "n_train": len(self.train.prompts)}}
        self._params: Any = None  # the weights `use_weights` gave last (on one device)
        self._reference: Any = None  # the starting model's weights (on one device), for the KL
        self._rows: tuple[tuple[int, int, int], dict[str, np.ndarray]] | None = None
        self._clock = {"handed": None, "eval_s": 0.0}  # when rows were last handed over; evaluation time since
        self._logp_program = jax.jit(lambda p, x, y: self._logp(p, {"x": x, "y": y}))

    # ------------------------------------------------------------------------------------------ the loop's task

    def example_inputs(self) -> tuple[jax.Array]:
        return (dummy_tokens(self.model_cfg),)

    def _logp(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return token_logprobs(self.model.apply({"params": params}, batch["x"]), batch["y"], self.rl.temperature)

    def loss(self, params: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, dict]:
        rl = self.rl
        loss, terms = policy_loss(
            self._logp(params, batch), batch.get("old_logp"), batch.get("ref_logp"), batch["advantage"], batch["mask"],
            loss_type=rl.loss_type, epsilon=rl.epsilon, beta=rl.beta, max_new_tokens=rl.max_new_tokens,
            epsilon_high=rl.epsilon if rl.epsilon_high is None else rl.epsilon_high)
        return loss, {**terms, **{k: batch[k].mean() for k in STAT_KEYS}}

    def evaluate(self, params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Each held-out row's negative log-likelihood of its reference answer (`eval_rows`) and its number of
        tokens: SFT's held-out loss, which shows how far RL moves the model from the answers it was taught, cheaply
        and on every prompt alike (sampling scores only what the model writes)."""
        logp_BW = token_logprobs(self.model.apply({"params": params}, batch["x"]), batch["y"], 1.0)
        return {"nll_B": -(logp_BW * batch["mask"]).sum(axis=1), "tokens_B": batch["mask"].sum(axis=1)}

    pretrained = Chat.pretrained  # init_from's weights, the vocabulary grown by the chat tokens as SFT grows it

    def check_resume(self, saved_meta: dict[str, Any], workdir: str) -> None:
        Chat.check_resume(self, saved_meta, workdir)  # the same model and tokenizer
        saved = renamed.saved_rl_settings(saved_meta)
        changed = changed_keys(saved, self.settings, base_config().rl.to_dict())
        if changed and not self.cfg.resume_changes:
            raise UserError(f"resuming {workdir} with other config.rl settings ({', '.join(changed)}): pass "
                            "--config.resume_changes=True to continue with them anyway, or use a new --config.workdir")

    def use_weights(self, params: Any) -> None:
        """The weights the loop trains or evaluates next (before it reads a step's rows or summarizes)."""
        self._params = params

    def train_rows(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        """This process's rows of step `step`: the rollouts of batch step // num_iterations."""
        g = step // self.rl.num_iterations
        key = (g, process_index, process_count)
        if self._rows is None or self._rows[0] != key:
            self._rows = key, self._batch_rows(g, step, process_index, process_count)
        self._clock.update(handed=time.perf_counter(), eval_s=0.0)  # the step's update starts about now
        return self._rows[1]

    def eval_rows(self, process_index: int, process_count: int) -> dict[str, list[dict[str, np.ndarray]]]:
        """Fixed batches of the held-out prompts that have an answer, each followed by it (filler rows at the end
        have no mask); the loss's other inputs, which `evaluate` ignores, are zeros (a batch has every key)."""
        rows, kinds = self._answers
        B = self.eval_rows_per_batch
        part = process_share(B, process_index, process_count)
        batches = []
        for idx, n_real in fixed_batches(np.arange(len(kinds)), B):
            batch = {k: v[idx] for k, v in rows.items()}
            batch["mask"] = batch["mask"] * (np.arange(B) < n_real)[:, None]
            batch.update({k: np.zeros((B,) + (batch["x"].shape[1:] if n == 2 else ()), np.float32)
                          for k, n in self.batch_ndims.items() if k not in batch})
            batches.append({k: v[part] for k, v in batch.items()})
        return {"val": batches} if batches else {}

    def summarize(self, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        """Held-out pass rates of the weights `use_weights` gave last (`pass_rates`), and the loss of the held-out
        reference answers (`evaluate`: nats per token, overall and per kind of prompt)."""
        t = time.perf_counter()
        with on_one_device():
            metrics = pass_rates(self.sampler, local_weights(self._params), self.held, self.rl.pass_k, self.cfg.seed)
        self._clock["eval_s"] += time.perf_counter() - t
        if "val" in outputs:
            kinds = self._answers[1]
            nll, tokens = (np.concatenate([np.asarray(o[k]) for o in outputs["val"]])[:len(kinds)]
                           for k in ("nll_B", "tokens_B"))
            metrics["val_answer_loss"] = float(nll.sum() / tokens.sum())
            metrics["val_answer_loss_by_dataset"] = {kind: float(nll[kinds == kind].sum() / tokens[kinds == kind].sum())
                                                  for kind in sorted(set(kinds.tolist()))}
        return {**metrics, "val_loss": -metrics["val_reward"]}

    def describe(self) -> str:
        return self._description

    def eval_line(self, step: int, metrics: dict[str, Any]) -> str:
        by_dataset = by_kind_text(metrics["val_pass_at_1_by_dataset"])
        return (f"step {step}: held-out pass@1 {metrics['val_pass_at_1']:.3f} (greedy; {by_dataset}), "
                f"pass@{metrics['pass_k']} {metrics['val_pass_at_k']:.3f}, sampled pass@1 "
                f"{metrics['val_sampled_pass_at_1']:.3f}, mean reward {metrics['val_reward']:.3f} "
                f"({metrics['val_prompts']} prompts)" + (f"; reference answers' loss {metrics['val_answer_loss']:.4f}"
                                                         if "val_answer_loss" in metrics else ""))

    def final_line(self, metrics: dict[str, Any]) -> str | None:
        return (f"done: held-out pass@1 {metrics['val_pass_at_1']:.3f} (greedy), pass@{metrics['pass_k']} "
                f"{metrics['val_pass_at_k']:.3f}; chat template in {self.cfg.workdir}/{TEMPLATE_FILE}")

    def _answer_rows(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(rows of the held-out prompts that have an answer the tokenizer can write, each followed by it and the
        end token, as SFT trained on it; their kinds), for `evaluate`."""
        answered, answers = [], []
        for ids, p in zip(self.held.ids, self.held.prompts, strict=True):
            if p.answer is None:
                continue
            try:
                tokens = self.tokenizer.encode_continuation(p.answer)  # after its prompt: no BOS
            except UserError:  # characters the vocabulary lacks: no likelihood to score
                continue
            answered.append((ids, p))
            answers.append([*tokens, self.end_id])
        longest = max((len(ids) + len(a) for (ids, _), a in zip(answered, answers, strict=True)), default=2)
        width = min(self.model_cfg.block_size, longest - 1)
        return token_rows([i for i, _ in answered], answers, width), np.array([p.kind for _, p in answered])

    # ------------------------------------------------------------------------------------------ rollouts

    def _batch_rows(self, g: int, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        """The rows of rollout batch `g` this process holds: sampled from the weights given now when `step` starts
        the batch, else (a run resumed inside a batch of num_iterations steps) read back from the work directory."""
        G, B = self.rl.num_generations, self.cfg.batch_size
        share = process_share(B, process_index, process_count)
        first, last = share.start // G, (share.stop - 1) // G  # the groups this process's rows fall in
        offset = share.start - first * G
        if step % self.rl.num_iterations:
            rows = self._read_rollouts(g, process_index, process_count)
            if rows is not None:
                return rows
            raise UserError(f"{self.cfg.workdir}/{ROLLOUTS_DIR} lacks rollout batch {g}, which step {step} reuses "
                            "(config.rl.num_iterations > 1): resume from a checkpoint at a step that starts a batch")
        with on_one_device():
            rows = self.rollouts(g, range(first, last + 1))
        rows = {k: v[offset:offset + share.stop - share.start] for k, v in rows.items()}
        if self.rl.num_iterations > 1:
            self._write_rollouts(g, process_index, process_count, rows)
        return rows

    def requests(self, g: int, groups: range) -> tuple[list[int], list[int]]:
        """(the training prompt of each rollout of `groups` of rollout batch `g`, its sampling seed): a pure
        function of (seed, g)."""
        G, P = self.rl.num_generations, self.cfg.batch_size // self.rl.num_generations
        chosen = batch_indices(self.cfg.seed, g, len(self.train.prompts), P)[groups.start:groups.stop]
        order = [int(p) for p in chosen for _ in range(G)]
        return order, [request_seed(self.cfg.seed, ROLLOUT_STREAM, g, groups.start * G + r) for r in range(len(order))]

    def rollouts(self, g: int, groups: range) -> dict[str, np.ndarray]:
        """Rows of `groups` of rollout batch `g` from the weights `use_weights` gave: sampled, scored, normalized,
        with the log-probabilities of the reference when beta > 0 and of the sampling policy when num_iterations > 1."""
        G = self.rl.num_generations
        params = jax.block_until_ready(local_weights(self._params))
        t1 = time.perf_counter()
        order, seeds = self.requests(g, groups)
        completions = self.sampler.sample(params, [self.train.ids[p] for p in order],
                                          [self.train.room[p] for p in order], seeds)
        new_tokens = sum(map(len, completions))
        t2 = time.perf_counter()
        rewards = self.sampler.score([self.train.prompts[p] for p in order], completions).reshape(-1, G)
        out = group_rows([self.train.ids[p] for p in order], completions, rewards, self.rl.loss_type != "dr_grpo",
                         self.width)
        if self.rl.mask_truncated_completions:
            out = mask_truncated(out, completions, self.end_id)
        if self.rl.beta > 0:  # with no KL penalty the reference is not run (nor held): TRL does the same
            if self._reference is None:
                self._reference = local_weights(self.pretrained())
            out["ref_logp"] = self._score(self._reference, out)
        if self.rl.num_iterations > 1:
            out["old_logp"] = self._score(params, out)
        handed = self._clock["handed"]  # the previous step's update: from its rows handed over to these weights
        update_s = t1 - handed - self._clock["eval_s"] if handed is not None else 0.0
        R = len(order)
        out["rollout_tokens_per_sec"] = np.full(R, new_tokens / (t2 - t1), np.float32)
        out["update_tokens_per_sec"] = np.full(R, self.cfg.batch_size * self.width / update_s if update_s > 0 else 0,
                                               np.float32)
        return out

    def _score(self, params: Any, rows: dict[str, np.ndarray]) -> np.ndarray:
        """Each completion token's log-probability under `params` (0 elsewhere)."""
        return np.asarray(self._logp_program(params, rows["x"], rows["y"])) * rows["mask"]

    def _rollout_path(self, g: int, process_index: int, process_count: int) -> storage.Location:
        name = f"{g}.npz" if process_count == 1 else f"{g}.{process_index}-of-{process_count}.npz"
        return storage.location(self.cfg.workdir, "config.workdir") / ROLLOUTS_DIR / name

    def _write_rollouts(self, g: int, process_index: int, process_count: int, rows: dict[str, np.ndarray]) -> None:
        """Keep batch g's rows for the steps that reuse it, and drop those of batches before the previous one and
        before the oldest checkpoint's, committed or still being written (no resume can reach them)."""
        path = self._rollout_path(g, process_index, process_count)
        buffer = io.BytesIO()
        np.savez(buffer, **rows)
        steps = [int(m[0]) for n in storage.names(checkpoint_dir(self.cfg.workdir)) if (m := re.match(r"\d+", n))]
        oldest = min([*steps, (g - 1) * self.rl.num_iterations]) // self.rl.num_iterations
        with storage.guard(path, "writing rollouts to"):
            path.parent.mkdir(parents=True, exist_ok=True)
            storage.write_bytes(path, buffer.getvalue())
            for name in storage.files(path.parent):
                if name.split(".")[0].isdigit() and int(name.split(".")[0]) < oldest:
                    with contextlib.suppress(FileNotFoundError):
                        (path.parent / name).unlink()

    def _read_rollouts(self, g: int, process_index: int, process_count: int) -> dict[str, np.ndarray] | None:
        path = self._rollout_path(g, process_index, process_count)
        with storage.guard(path, "reading rollouts from"):
            if not path.exists():
                return None
            with np.load(io.BytesIO(path.read_bytes())) as saved:
                return {k: saved[k] for k in saved.files}
