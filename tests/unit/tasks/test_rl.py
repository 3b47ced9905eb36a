"""Task rl: the GRPO loss variants against a float64 reference, rewards and prompts, and RL on the loop (the reward
rises on a toy task, a resumed run equals an uninterrupted one, a failing reward stops the run with one line)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.chat import ALPHABET
from helpers.models import save_random_lm
from reference.numpy_reference_rl import grpo_loss_and_grad

from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.model.config import ModelConfig
from jaxgpt.tasks.rl.loss import group_advantages, policy_loss, token_logprobs
from jaxgpt.tasks.rl.prompts import load_prompts, split_prompts
from jaxgpt.tasks.rl.rewards import RewardError, parse_rewards, total_reward
from jaxgpt.train.config import RLConfig, base_config


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("policy", ["on", "off"])
def test_loss_variants_equal_the_float64_reference_in_value_and_gradient(loss_type: str, policy: str) -> None:
    """Off-policy: the old log-probabilities are far enough from the current ones that both clip sides bind, with
    a KL penalty; rows of different lengths and one with no completion token (all weights checked)."""
    rng = np.random.default_rng(0)
    B, W, V, T, M = 6, 5, 7, 0.7, 5
    logits = rng.normal(size=(B, W, V)).astype(np.float32)
    y = rng.integers(0, V, (B, W)).astype(np.int32)
    mask = (np.arange(W)[None] < np.array([5, 3, 1, 0, 4, 2])[:, None]).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    logp = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(y), T))
    old = (logp + rng.normal(scale=0.4, size=(B, W))).astype(np.float32) if policy == "off" else None
    ref = (logp + rng.normal(scale=0.3, size=(B, W))).astype(np.float32)
    options = {"loss_type": loss_type, "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04 if policy == "off" else 0.0,
               "max_new_tokens": M}

    def loss(z: jax.Array) -> jax.Array:
        return policy_loss(token_logprobs(z, jnp.asarray(y), T), None if old is None else jnp.asarray(old),
                           jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask), **options)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logits))
    want, want_grad = grpo_loss_and_grad(logits, y, old, ref, adv, mask, temperature=T, **options)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert np.abs(want_grad).max() > 1e-3  # the gradient is not trivially zero
    if policy == "off":
        _, terms = policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
                               jnp.asarray(mask), **options)
        assert 0 < float(terms["clip_fraction"]) < 1 and float(terms["kl"]) > 0


def test_advantages_are_normalized_within_each_group() -> None:
    a = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, 0.0, 1.0, 1.0]]), scale=True)
    np.testing.assert_allclose(a[0], np.array([1, -1, -1, 1]) * 0.5 / (np.std([1, 0, 0, 1], ddof=1) + 1e-4), 1e-6)
    assert not a[1].any()  # no signal: every reward equal
    np.testing.assert_allclose(group_advantages(np.array([[2.0, 0.0, 1.0, 1.0]]), scale=False), [[1, -1, 0, 0]])


def test_a_truncated_completion_keeps_its_reward_but_leaves_the_loss() -> None:
    from jaxgpt.tasks.rl.rollouts import group_rows, mask_truncated

    END = 9
    completions = [[4, 5, END], [4, 5, 6, 7], [6, END], [4, 4, 4, 4]]  # the second and last were cut at 4 tokens
    rows = group_rows([[1, 2]] * 4, completions, np.array([[1.0, 0.0], [1.0, 0.0]]), True, width=5)
    masked = mask_truncated(rows, completions, END)
    np.testing.assert_array_equal(masked["mask"].sum(axis=1), [3, 0, 2, 0])
    np.testing.assert_array_equal(masked["mask"][0], rows["mask"][0])
    np.testing.assert_array_equal(masked["advantage"], rows["advantage"])  # the baseline still counts them
    assert rows["mask"][1].sum() == 4


def test_rewards_are_weighted_and_a_failing_one_is_one_line_naming_it_and_the_prompt(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def short(messages, completion):\n    return float(len(completion) <= 2)\n"
        "def broken(messages, completion):\n    raise ValueError('bad\\nthing')\n"
        "def nan(messages, completion):\n    return float('nan')\n"
        "def text(messages, completion):\n    return 'yes'\n")
    f = tmp_path / "my_rewards.py"
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    rewards = parse_rewards(f"exact=2, {f}:short=0.5")
    assert total_reward(rewards, prompt, " 5", "5", "p:1") == 2.5
    assert total_reward(rewards, prompt, "six", "5", "p:1") == 0.0
    for name, says in (("broken", "raised ValueError: bad thing"), ("nan", "returned nan"), ("text", "returned 'yes'")):
        with pytest.raises(RewardError) as e:
            total_reward(parse_rewards(f"{f}:{name}"), prompt, "5", None, "prompts.jsonl:7")
        line = str(e.value)
        assert "\n" not in line and f"{f}:{name}" in line and says in line and "prompts.jsonl:7" in line
    for spec, says in ((f"{f}:missing", "has no function 'missing'"), ("no_such_module_xyz:f", "cannot load"),
                       ("exact=abc", "not NAME or NAME=WEIGHT"), ("short", "neither 'exact' nor module:function")):
        with pytest.raises(UserError, match=says):
            parse_rewards(spec)


def test_prompts_from_jsonl_take_three_forms_and_a_bad_line_names_its_file_and_line(tmp_path: Path) -> None:
    user = {"role": "user", "content": "What is 1 + 1?"}
    lines = [{"messages": [user, {"role": "assistant", "content": "2"}]}, {"messages": [user], "answer": "2"},
             {"messages": [user]}]
    good = tmp_path / "p.jsonl"
    good.write_text("\n".join(map(json.dumps, lines)) + "\n")
    prompts, _ = load_prompts(RLConfig(data=str(good)), 0)
    assert [(p.messages, p.answer) for p in prompts] == [([user], "2"), ([user], "2"), ([user], None)]
    for n, bad in ((2, "{not json"), (2, json.dumps({"messages": [user], "answer": 2})),
                   (2, json.dumps({"messages": [{"role": "assistant", "content": "x"}]}))):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(lines[0]) + "\n" + bad + "\n")
        with pytest.raises(UserError, match=rf"^{path}:{n}: "):
            load_prompts(RLConfig(data=str(path)), 0)


def test_held_out_prompts_are_those_sft_holds_out() -> None:
    from jaxgpt.data.conversations import builtin_conversations, split_held_out

    c = RLConfig(examples=400, val_fraction=0.1)
    prompts, _ = load_prompts(c, 3)
    train, held = split_prompts(prompts, c.val_fraction)
    _, sft_held = split_held_out(builtin_conversations(3, 400, c.datasets.split(",")), c.val_fraction)
    assert [p.messages for p in held] == [conv[:-1] for conv in sft_held] and len(train) + len(held) == 400


# ----------------------------------------------------------------------------------------------------
# RL on the loop

A_REWARD = "def is_a(messages, completion):\n    return float(completion == 'a')\n"
# A dense signal: most groups of 3-token completions have a spread, so the policy moves from the first step.
VOWELS_REWARD = "def vowels(messages, completion):\n    return float(sum(c in 'aeiou' for c in completion))\n"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("base")
    save_random_lm(workdir, ModelConfig(vocab_size=len(ALPHABET), block_size=64, n_layer=1, n_head=2, n_embd=32),
                   CharTokenizer(ALPHABET))
    return workdir


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
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
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
    logged = [json.loads(line) for line in (whole_dir / "metrics.jsonl").read_text().splitlines()]
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
    import signal
    import subprocess
    import sys

    from helpers import ROOT

    from jaxgpt.io.checkpoint import Checkpointer

    (tmp_path / "toy.py").write_text(A_REWARD)
    flags = lambda workdir: [
        sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'chat_rl.py'}",
        f"--config.workdir={workdir}", f"--config.init_from=workdir:{base_run}", "--config.rl.examples=200",
        "--config.rl.val_fraction=0.1", f"--config.rl.reward={tmp_path / 'toy.py'}:is_a", "--config.batch_size=16",
        "--config.rl.num_generations=4", "--config.rl.max_new_tokens=3", "--config.rl.num_iterations=2",
        "--config.rl.eval_prompts=4", "--config.rl.pass_k=2", "--config.max_steps=16", "--config.ckpt_interval=3",
        "--config.eval_interval=16", "--config.log_interval=1", "--config.optim.lr=0.03", "--config.rl.beta=0.1",
        "--config.compilation_cache_dir="]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = subprocess.run(flags(straight), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    for target in (5, 11):
        proc = subprocess.Popen(flags(killed), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            if line.startswith("step ") and int(line.split("/")[0].split()[1]) >= target:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed = subprocess.run(flags(killed), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert resumed.returncode == 0 and "resuming at step" in resumed.stdout, resumed.stderr[-2000:]
    want, got = Checkpointer(straight, read_only=True), Checkpointer(killed, read_only=True)
    assert want.latest_step() == got.latest_step() == 16
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), want.restore_params(16),
                 got.restore_params(16))
