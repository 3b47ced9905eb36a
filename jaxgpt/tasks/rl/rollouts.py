"""Rollouts of task rl: groups of completions sampled through the serving engine, scored, and laid out as rows.

A prompt is its conversation in the chat format followed by `<|assistant|>` (the ids `jaxgpt serve` renders for
it); its completions are sampled by `generate_many`, the continuous-batching engine's batched decoding, until the
chat format's end token or the room the context leaves (at most config.rl.max_new_tokens). Completion r of a batch
draws its noise from its own seed, `request_seed(seed, stream, batch, r)`, so the rollouts of a step depend only
on (seed, step) and the weights: a resumed run samples the same ones.

A row holds one completion after its prompt: inputs x, targets y, and the loss mask over the completion's tokens
(its end token included: stopping is learnt too), the completion's group-normalized advantage, and per-row figures
the loss reports as metrics (its reward, its group's spread, whether the group had no signal, its length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxgpt.data.conversations import mean_by_kind
from jaxgpt.data.model_chat import chat_prompt_ids
from jaxgpt.data.streams import RL_EVAL_STREAM
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate.many import generate_many
from jaxgpt.generate.text_stream import until_eot
from jaxgpt.model.config import ModelConfig
from jaxgpt.tasks.rl.loss import group_advantages
from jaxgpt.tasks.rl.prompts import Prompt
from jaxgpt.tasks.rl.rewards import Reward, total_reward
from jaxgpt.train.config import RLConfig

PASS = 1.0  # a completion passes when its reward reaches this (the built-in checker's right answer)


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts as the engine takes them: ids ending with `<|assistant|>`, and the new tokens each has room for."""

    prompts: list[Prompt]
    ids: list[list[int]]
    room: list[int]


def encode_prompts(prompts: Sequence[Prompt], tokenizer: Tokenizer, block_size: int,
                   max_new_tokens: int) -> tuple[PromptSet, int]:
    """(the prompts that leave room for a completion, how many were dropped for filling the context). A prompt
    the tokenizer cannot encode is a UserError naming its origin."""
    kept, ids, room = [], [], []
    for p in prompts:
        try:
            prompt = chat_prompt_ids(tokenizer, p.messages)
        except UserError as e:
            raise UserError(f"{p.origin}: {e}") from None
        left = min(max_new_tokens, block_size - len(prompt))
        if left >= 1:
            kept.append(p)
            ids.append(prompt)
            room.append(left)
    return PromptSet(kept, ids, room), len(prompts) - len(kept)


def request_seed(*entropy: int) -> int:
    """A completion's sampling seed: a pure function of the integers given (seed, stream, batch, row)."""
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])


class Sampler:
    """Samples completions through the engine and scores them with the run's rewards."""

    def __init__(self, model_cfg: ModelConfig, tokenizer: Tokenizer, end_id: int, rl: RLConfig,
                 rewards: list[Reward]) -> None:
        self.model_cfg, self.tokenizer, self.end_id, self.rl, self.rewards = model_cfg, tokenizer, end_id, rl, rewards

    def sample(self, params: Any, ids: Sequence[list[int]], room: Sequence[int], seeds: Sequence[int],
               greedy: bool = False) -> list[list[int]]:
        """Each prompt's completion (ending with the end token when it stopped), `rl.slots` at a time."""
        return generate_many(params, self.model_cfg, ids, max_new_tokens=list(room), seeds=list(seeds),
                             temperature=0.0 if greedy else self.rl.temperature, top_p=self.rl.top_p,
                             eot_token=self.end_id, vocab_limit=self.tokenizer.vocab_size, slots=self.rl.slots)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(until_eot(tokens, self.end_id))

    def score(self, prompts: Sequence[Prompt], completions: Sequence[list[int]]) -> np.ndarray:
        return np.array([total_reward(self.rewards, p.messages, self.text(c), p.answer, p.origin)
                         for p, c in zip(prompts, completions, strict=True)], np.float64)


def token_rows(ids: Sequence[list[int]], completions: Sequence[list[int]], width: int) -> dict[str, np.ndarray]:
    """Rows of `width` inputs, each a prompt (`ids`) followed by its completion, then padding: inputs x, targets y
    and the mask of the completion's targets (a completion cut at the row's end keeps what fits)."""
    R = len(ids)
    full_RW = np.zeros((R, width + 1), np.int32)
    mask_RW = np.zeros((R, width), np.float32)
    for r, (prompt, completion) in enumerate(zip(ids, completions, strict=True)):
        n, m = len(prompt), min(len(completion), width + 1 - len(prompt))
        full_RW[r, :n + m] = [*prompt, *completion[:m]]
        mask_RW[r, n - 1:n - 1 + m] = 1.0  # target j is token j + 1: the completion's are targets n - 1 ..
    return {"x": full_RW[:, :-1], "y": full_RW[:, 1:], "mask": mask_RW}


def group_rows(ids: Sequence[list[int]], completions: Sequence[list[int]], rewards_PG: np.ndarray, scale: bool,
               width: int) -> dict[str, np.ndarray]:
    """Rows of `width` inputs for P groups of G completions (`ids`: each row's prompt; rows group by group)."""
    P, G = rewards_PG.shape
    R = P * G
    rows = token_rows(ids, completions, width)
    spread_P = rewards_PG.std(axis=1)
    return {**rows, "advantage": group_advantages(rewards_PG, scale).reshape(R),
            "reward": rewards_PG.reshape(R).astype(np.float32),
            "group_spread": np.repeat(spread_P, G).astype(np.float32),
            "no_signal": np.repeat(spread_P == 0, G).astype(np.float32),
            "completion_tokens": rows["mask"].sum(axis=1)}


def mask_truncated(rows: dict[str, np.ndarray], completions: Sequence[list[int]], end_id: int) -> dict[str, np.ndarray]:
    """`rows` with the loss mask of each completion that has no end token (cut at its room) set to 0: its reward
    and advantage are kept (the group's baseline counts it), but none of its tokens is learnt from."""
    ended_R = np.array([end_id in c for c in completions], np.float32)
    return {**rows, "mask": rows["mask"] * ended_R[:, None]}


def pass_rates(sampler: Sampler, params: Any, held: PromptSet, k: int, seed: int) -> dict[str, Any]:
    """Held-out pass@1 of greedy completions, pass@k and pass@1 of k sampled ones (a completion passes when its
    reward reaches PASS), the mean greedy reward, and greedy pass@1 per kind of prompt (the built-in datasets)."""
    N = len(held.prompts)
    greedy = sampler.score(held.prompts, sampler.sample(params, held.ids, held.room, [0] * N, greedy=True))
    rows = [(i, j) for i in range(N) for j in range(k)]
    sampled = sampler.score([held.prompts[i] for i, _ in rows], sampler.sample(
        params, [held.ids[i] for i, _ in rows], [held.room[i] for i, _ in rows],
        [request_seed(seed, RL_EVAL_STREAM, i, j) for i, j in rows])).reshape(N, k)
    kinds = np.array([p.kind for p in held.prompts])
    return {"val_reward": float(greedy.mean()), "val_pass_at_1": float(np.mean(greedy >= PASS)),
            "val_pass_at_k": float(np.mean((sampled >= PASS).any(axis=1))),
            "val_sampled_pass_at_1": float(np.mean(sampled >= PASS)), "val_prompts": N, "pass_k": k,
            "val_pass_at_1_by_dataset": mean_by_kind(kinds, greedy >= PASS)}
