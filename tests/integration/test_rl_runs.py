"""RL (GRPO) runs on the training loop: the reward rises on a toy task, resume inside a batch of rollouts, a
reward that turns NaN, SIGKILL and resume (moved from tests/unit/tasks/test_rl.py: each trains a model)."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import logged_records
from helpers.chat import save_char_base

from jaxgpt.errors import UserError
from jaxgpt.tasks.rl.rewards import RewardError
from jaxgpt.train.config import base_config

# A dense signal: most groups of 3-token completions have a spread, so the policy moves from the first step.
A_REWARD = "def is_a(messages, completion):\n    return float(completion == 'a')\n"
VOWELS_REWARD = "def vowels(messages, completion):\n    return float(sum(c in 'aeiou' for c in completion))\n"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_base(tmp_path_factory.mktemp("base"))


def rl_config(workdir: Path, base: Path, reward: str, **overrides: object):
    """A bandit: completions of one token, rewarded by `reward` (a file's function)."""
    c = base_config()
    c.task, c.workdir, c.init_from = "rl", str(workdir), f"workdir:{base}"
    c.rl.examples, c.rl.val_fraction, c.rl.datasets = 200, 0.1, "arithmetic"
    c.rl.reward, c.rl.num_generations, c.rl.max_new_tokens, c.rl.slots = reward, 4, 1, 32
    c.rl.eval_prompts, c.rl.pass_k = 8, 2
    c.batch_size, c.max_steps, c.eval_interval, c.log_interval, c.ckpt_interval = 32, 24, 12, 4, 12
    c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = 3e-2, 1, 0.0
    c.compilation_cache_dir = ""
    c.update_from_flattened_dict(overrides)
    return c


def test_the_reward_rises_on_a_toy_task_and_the_run_is_a_chat_run(tmp_path: Path, base_run: Path) -> None:
    from helpers import logged_eval, train_run

    from jaxgpt.generate.chat import ChatModel
    from jaxgpt.io import weights

    (tmp_path / "toy.py").write_text(A_REWARD)
    workdir = tmp_path / "run"
    # 64 one-character completions a step, about one 'a' in each (of ~75 characters): the first signal comes in the
    # first steps whatever the prompts (32 a step depended on a lucky 'a' early: one step of signal is not enough)
    result = train_run(rl_config(workdir, base_run, f"{tmp_path / 'toy.py'}:is_a", batch_size=64,
                                 **{"rl.num_generations": 8, "rl.slots": 64}))
    rows = logged_records(workdir)
    rewards = [r["train_reward"] for r in rows if "train_reward" in r]
    assert rewards[0] < 0.2 and rewards[-1] > 0.8, rewards  # one character of ~75 at first, then nearly always
    passes = [v for _, v in logged_eval(workdir, "val_pass_at_1")]
    assert passes[-1] == 1.0 and result["val_pass_at_k"] == 1.0
    answer_loss = [v for _, v in logged_eval(workdir, "val_answer_loss")]  # the held-out answers: digits, not 'a'
    assert len(answer_loss) == 2 and answer_loss[1] > answer_loss[0] > 0, answer_loss
    assert result["val_answer_loss_by_dataset"] == {"arithmetic": result["val_answer_loss"]}
    last = rows[-2] if "val_loss" in rows[-1] else rows[-1]
    for key in ("train_group_spread", "train_no_signal", "train_clip_fraction",
                "train_completion_tokens", "train_rollout_tokens_per_sec", "train_update_tokens_per_sec"):
        assert math.isfinite(last[key]), key
    assert last["train_completion_tokens"] == 1.0 and last["train_clip_fraction"] == 0.0
    assert "train_kl" not in last  # beta 0: no reference model is run, so there is no KL to report
    loaded = weights.load(f"workdir:{workdir}")  # sample.py --chat and jaxgpt serve read a run through these
    chat = ChatModel.from_run(loaded.params, loaded.model, loaded.tokenizer(), loaded.meta, None)
    assert chat.replies([("q", [{"role": "user", "content": "What is 1 + 1?"}])], max_new_tokens=1, seed=0,
                        temperature=0.0, top_p=1.0, slots=1) == ["a"]


def test_resumed_inside_a_batch_of_rollouts_it_equals_the_uninterrupted_run(tmp_path: Path, base_run: Path) -> None:
    """num_iterations 2 and a checkpoint after step 3: the resumed run reuses batch 1's rollouts (sampled at step
    2, before the checkpoint) from the work directory and samples the rest from the restored weights."""
    from helpers import train_run

    from jaxgpt.io.checkpoint import Checkpointer
    from jaxgpt.tasks import build
    from jaxgpt.train.config import from_config_dict

    (tmp_path / "toy.py").write_text(VOWELS_REWARD)
    reward = f"{tmp_path / 'toy.py'}:vowels"
    overrides = {"max_steps": 6, "ckpt_interval": 3, "eval_interval": 6, "rl.num_iterations": 2,
                 "rl.max_new_tokens": 3, "rl.beta": 0.1, "rl.loss_type": "grpo"}
    whole_dir, split_dir = tmp_path / "whole", tmp_path / "split"
    whole = train_run(rl_config(whole_dir, base_run, reward, **overrides))
    shutil.copytree(whole_dir, split_dir)  # the run as a SIGKILL after step 3's checkpoint leaves it
    shutil.rmtree(split_dir / "checkpoints" / "6")
    resumed = train_run(rl_config(split_dir, base_run, reward, **overrides))
    assert resumed["steps"] == 3 and resumed["val_pass_at_k"] == whole["val_pass_at_k"]
    logged = logged_records(whole_dir)
    kls = [r["train_kl"] for r in logged if "train_loss" in r]  # beta > 0: the reference is run, the KL reported
    assert kls and min(kls) > 0, kls
    task = build(from_config_dict(rl_config(split_dir, base_run, reward, **overrides)))
    ckpt = Checkpointer(split_dir)
    meta = ckpt.read_meta(6)
    ckpt.close()
    del meta["rl"]["settings"]["mask_truncated_completions"]  # a run saved before the setting existed: its default
    task.check_resume(meta, str(split_dir))
    meta["rl"]["settings"]["mask_truncated_completions"] = True
    with pytest.raises(UserError, match="mask_truncated_completions"):
        task.check_resume(meta, str(split_dir))
    for a, b in zip(jax.tree.leaves(whole["state"]["params"]), jax.tree.leaves(resumed["state"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_reward_that_turns_nan_stops_the_run_with_one_line_and_keeps_its_checkpoint(tmp_path: Path,
                                                                                     base_run: Path) -> None:
    from helpers import train_run

    from jaxgpt.io.checkpoint import Checkpointer

    (tmp_path / "flaky.py").write_text("calls = 0\ndef flaky(messages, completion):\n    global calls\n"
                                       "    calls += 1\n    return float('nan') if calls > 32 * 5 else 0.0\n")
    c = rl_config(tmp_path / "run", base_run, f"{tmp_path / 'flaky.py'}:flaky", max_steps=8, ckpt_interval=4,
                  eval_interval=100)
    with pytest.raises(RewardError) as e:  # the rollouts of step 5 (the sixth) meet the NaN
        train_run(c)
    assert "\n" not in str(e.value) and "flaky" in str(e.value) and "built-in conversation" in str(e.value)
    ckpt = Checkpointer(tmp_path / "run")
    assert ckpt.latest_step() == 4 and ckpt.read_meta(4)["rl"]["n_train"] > 0
    ckpt.close()


@pytest.mark.slow
def test_sigkill_and_resume_equal_the_uninterrupted_run(tmp_path: Path, base_run: Path) -> None:
    """train.py killed with SIGKILL after its checkpoint at step 4 or later, twice, then resumed to the end: the
    weights equal an uninterrupted run's bit for bit (two updates per batch of rollouts: a kill may land inside one)."""
    from helpers import ROOT
    from helpers.runs import killed_twice_equals_straight

    (tmp_path / "toy.py").write_text(A_REWARD)
    flags = lambda workdir: [
        sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'chat_rl.py'}",
        f"--config.workdir={workdir}", f"--config.init_from=workdir:{base_run}", "--config.rl.examples=200",
        "--config.rl.val_fraction=0.1", f"--config.rl.reward={tmp_path / 'toy.py'}:is_a", "--config.batch_size=16",
        "--config.rl.num_generations=4", "--config.rl.max_new_tokens=3", "--config.rl.num_iterations=2",
        "--config.rl.eval_prompts=4", "--config.rl.pass_k=2", "--config.max_steps=16", "--config.ckpt_interval=3",
        "--config.eval_interval=16", "--config.log_interval=1", "--config.optim.lr=0.03", "--config.rl.beta=0.1",
        "--config.compilation_cache_dir="]
    killed_twice_equals_straight(flags, tmp_path, 16)
