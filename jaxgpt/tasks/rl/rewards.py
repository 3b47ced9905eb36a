"""Rewards of task rl: the built-in exact checker and functions the user writes, weighted and summed.

`config.rl.reward` names one or several, comma-separated, each optionally `=WEIGHT` (default 1):

* `exact`: 1.0 when the completion, stripped, equals the prompt's answer (the built-in datasets' answers, a JSONL
  line's `answer` field or the conversation's last assistant turn), else 0.0: what SFT's exact match checks;
* `module:function` (importable, e.g. a file beside train.py) or `path/to/file.py:function`: a function of
  (prompt messages, completion text) returning a number, e.g.

      def brevity(messages: list[dict[str, str]], completion: str) -> float:
          return 1.0 if len(completion) <= 20 else 0.0

A reward that raises, or returns a non-number, NaN or an infinity, stops the run with one line naming the function
and the prompt (`RewardError`, a UserError: the loop keeps its last checkpoint); a name that does not resolve to a
function is one line before anything runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path

from jaxgpt.data.conversations import Conversation
from jaxgpt.errors import UserError, one_line

EXACT = "exact"
UserReward = Callable[[Conversation, str], float]


@dataclasses.dataclass(frozen=True)
class Reward:
    """One term of the reward: its name as configured, its weight, and its function of (prompt, completion,
    answer); user functions ignore the answer."""

    name: str
    weight: float
    score: Callable[[Conversation, str, str | None], object]


def exact(_messages: Conversation, completion: str, answer: str | None) -> float:
    return float(completion.strip() == (answer or "").strip())


def _user_function(spec: str) -> UserReward:
    """The function `module:function` or `path/file.py:function` names; a UserError saying what is missing."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UserError(f"config.rl.reward: {spec!r} is neither {EXACT!r} nor module:function (or "
                        "path/file.py:function)")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().absolute()
            loader = importlib.util.spec_from_file_location(f"jaxgpt_reward_{path.stem}", path)
            if loader is None or not path.is_file():
                raise UserError(f"config.rl.reward={spec}: {path} is not a file")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a module beside the command, as python -m
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # an import error, or the module raising while it loads
        raise UserError(f"config.rl.reward={spec}: cannot load {where}: {type(e).__name__}: "
                        f"{one_line(e, 200)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"config.rl.reward={spec}: {where} has no function {name!r}")
    return fn


def parse_rewards(spec: str) -> list[Reward]:
    """The reward terms of config.rl.reward (see the module docstring)."""
    rewards = []
    for term in (t.strip() for t in spec.split(",")):
        name, has_weight, weight_text = term.partition("=")
        name = name.strip()
        try:
            weight = float(weight_text) if has_weight else 1.0
        except ValueError:
            weight = math.nan
        if not name or not math.isfinite(weight):
            raise UserError(f"config.rl.reward={spec!r}: {term!r} is not NAME or NAME=WEIGHT (e.g. "
                            "exact=1,my_rewards:brevity=0.1)")
        if name == EXACT:
            rewards.append(Reward(name, weight, exact))
        else:
            fn = _user_function(name)
            rewards.append(Reward(name, weight, lambda messages, completion, _answer, fn=fn: fn(messages, completion)))
    return rewards


class RewardError(UserError):
    """A reward function failed on a prompt: the run stops (its last checkpoint kept) with this one line."""


def total_reward(rewards: list[Reward], messages: Conversation, completion: str, answer: str | None,
                 where: str) -> float:
    """The weighted sum of the terms for one completion of the prompt `messages` (from `where`)."""
    total = 0.0
    for r in rewards:
        asked = f"on prompt {where} ({one_line(messages[-1]['content'], 60)!r})"
        try:
            value = r.score(messages, completion, answer)
        except Exception as e:
            raise RewardError(f"reward {r.name} raised {type(e).__name__}: {one_line(e, 200)} {asked}: fix the "
                              "function; the run's last checkpoint is kept") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(f"reward {r.name} returned {one_line(repr(value), 60)} {asked}: a reward must be a "
                              "finite number; the run's last checkpoint is kept")
        total += r.weight * float(value)
    return total
