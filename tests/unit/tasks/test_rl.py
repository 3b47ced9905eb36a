"""Task rl: the GRPO loss variants against a float64 reference, rewards and prompts (its runs on the loop:
tests/integration/test_rl_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.bos_tokenizer import bos_chat
from reference.numpy_reference_rl import grpo_loss_and_grad

from jaxgpt.data.model_chat import chat_prompt_ids
from jaxgpt.errors import UserError
from jaxgpt.tasks.rl.loss import group_advantages, policy_loss, token_logprobs
from jaxgpt.tasks.rl.prompts import Prompt, load_prompts, split_prompts
from jaxgpt.tasks.rl.rewards import RewardError, parse_rewards, total_reward
from jaxgpt.tasks.rl.task import RL
from jaxgpt.train.config import RLConfig


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
    with pytest.raises(UserError, match=r"^2 prompts are too few .* change config\.rl\.val_fraction$"):
        split_prompts(prompts[:2], c.val_fraction)


def test_answer_rows_of_a_bos_tokenizer_continue_the_prompt_without_a_bos() -> None:
    """A Llama-3-style tokenizer puts <|begin_of_text|> before a whole text: the prompt starts with it once, and the
    reference answer after the prompt is its text and the end token, with no BOS in between."""
    pytest.importorskip("tokenizers")
    chat = bos_chat()
    prompt = Prompt([{"role": "user", "content": "What is 2 + 3?"}], "5", "arithmetic", "test")
    ids = chat_prompt_ids(chat, prompt.messages)
    assert ids[0] == chat.base.bos_token and ids.count(chat.base.bos_token) == 1
    task = SimpleNamespace(held=SimpleNamespace(ids=[ids], prompts=[prompt]), tokenizer=chat, end_id=chat.end_id,
                           model_cfg=SimpleNamespace(block_size=64))
    rows, kinds = RL._answer_rows(task)
    assert rows["x"][0, :len(ids)].tolist() == ids and kinds.tolist() == ["arithmetic"]
    assert chat.decode(rows["y"][0][rows["mask"][0] > 0]) == "5<|eot_id|>"
