"""Task dpo: the preference losses against a float64 reference, and preference data (its runs on the loop:
tests/integration/test_dpo_runs.py)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference.numpy_reference_dpo import dpo_loss_and_grad

from jaxgpt.data.preferences import DPO_LOSSES
from jaxgpt.tasks.dpo.loss import REFERENCE_FREE, preference_loss, reply_logps

OPTIONS = {"sigmoid": {"beta": 0.1}, "ipo": {"beta": 0.5}, "hinge": {"beta": 0.3},
           "simpo": {"beta": 2.0, "simpo_gamma": 0.5}, "orpo": {"beta": 0.1, "orpo_lambda": 0.2}}


def _pairs(rng: np.random.Generator, B: int = 5, W: int = 6, V: int = 7) -> tuple[np.ndarray, ...]:
    """Chosen and rejected rows: logits, targets, masks of replies of different lengths (one of 1 token)."""
    out = []
    for lengths in ([6, 3, 1, 4, 2], [2, 5, 3, 1, 6]):
        out += [rng.normal(size=(B, W, V)).astype(np.float32), rng.integers(0, V, (B, W)).astype(np.int32),
                (np.arange(W)[None] >= W - np.array(lengths)[:, None]).astype(np.float32)]
    return tuple(out)


def _jax_loss(logits_c, y_c, m_c, logits_r, y_r, m_r, ref_c, ref_r, **options):
    sums = reply_logps(logits_c, y_c, m_c), reply_logps(logits_r, y_r, m_r)
    return preference_loss(*sums, m_c.sum(1), m_r.sum(1), ref_c, ref_r, **options)


@pytest.mark.parametrize(("loss_type", "label_smoothing", "rpo_alpha"),  # label smoothing: sigmoid's and simpo's
                         [(t, 0.0, 0.0) for t in DPO_LOSSES] + [("sigmoid", 0.2, 0.0), ("simpo", 0.2, 0.0)]
                         + [(t, 0.0, 0.7) for t in ("sigmoid", "ipo", "simpo")])
def test_each_loss_equals_the_float64_reference_in_value_gradient_and_metrics(loss_type: str, label_smoothing: float,
                                                                              rpo_alpha: float) -> None:
    rng = np.random.default_rng(1)
    logits_c, y_c, m_c, logits_r, y_r, m_r = _pairs(rng)
    ref = None if loss_type in REFERENCE_FREE else [
        (np.asarray(reply_logps(jnp.asarray(z), jnp.asarray(y), jnp.asarray(m))) + rng.normal(scale=1.5, size=5))
        .astype(np.float32) for z, y, m in ((logits_c, y_c, m_c), (logits_r, y_r, m_r))]
    options = {"loss_type": loss_type, **OPTIONS[loss_type], "label_smoothing": label_smoothing,
               "rpo_alpha": rpo_alpha}

    def loss(zc: jax.Array, zr: jax.Array) -> tuple[jax.Array, dict]:
        refs = (None, None) if ref is None else tuple(map(jnp.asarray, ref))
        return _jax_loss(zc, jnp.asarray(y_c), jnp.asarray(m_c), zr, jnp.asarray(y_r), jnp.asarray(m_r), *refs,
                         **options)

    (value, metrics), (grad_c, grad_r) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(logits_c), jnp.asarray(logits_r))
    want, want_c, want_r, want_metrics = dpo_loss_and_grad(logits_c, y_c, m_c, logits_r, y_r, m_r,
                                                           *(ref or (None, None)), **options)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_c), want_c, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad_r), want_r, rtol=1e-4, atol=1e-7)
    assert min(np.abs(want_c).max(), np.abs(want_r).max()) > 1e-3  # both sides of the pair are learnt from
    for name, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), v, rtol=1e-5, atol=1e-6, err_msg=name)
    assert 0 < want_metrics["rewards/accuracies"] < 1  # the pairs disagree: the metric is not trivially 0 or 1


def test_at_the_reference_the_sigmoid_loss_is_ln_2_with_zero_margins() -> None:
    """Policy = reference (the first step of a run whose reference log-probabilities are the starting model's)."""
    logits_c, y_c, m_c, logits_r, y_r, m_r = map(jnp.asarray, _pairs(np.random.default_rng(2)))
    ref = reply_logps(logits_c, y_c, m_c), reply_logps(logits_r, y_r, m_r)
    loss, metrics = _jax_loss(logits_c, y_c, m_c, logits_r, y_r, m_r, *ref, loss_type="sigmoid", beta=0.1)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-7) and np.float32(loss) == np.float32(0.6931472)
    assert float(metrics["rewards/margins"]) == 0.0 and float(metrics["rewards/chosen"]) == 0.0
    assert float(metrics["rewards/accuracies"]) == 0.0  # a tie is no win


# ----------------------------------------------------------------------------------------------------
# Preference data


def _tokenizer():
    from helpers.chat import ALPHABET

    from jaxgpt.data.conversations import chat_tokenizer
    from jaxgpt.data.tokenizer import CharTokenizer

    return chat_tokenizer(CharTokenizer(ALPHABET))


@pytest.mark.parametrize(("line", "says"), [
    ('{"prompt": "hi", "chosen": "a"', "not valid JSON"),
    ('{"prompt": "hi", "chosen": "a"}', "no 'rejected'"),
    ('{"prompt": "hi", "chosen": "", "rejected": "b"}', '"chosen" is empty'),
    ('{"prompt": "hi", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]}', "one assistant message"),
    ('{"prompt": "hi", "chosen": "same", "rejected": "same"}', "chosen equals rejected"),
    ('{"prompt": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"}', '"prompt": turns out'),
    ('{"prompt": "", "chosen": "a", "rejected": "b"}', '"prompt" is empty'),
])
def test_a_bad_pair_is_one_line_naming_its_file_and_line(tmp_path, line: str, says: str) -> None:
    from jaxgpt.data.preferences import load_pairs
    from jaxgpt.errors import UserError

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "hi", "chosen": "a", "rejected": "b"}\n\n' + line + "\n")
    with pytest.raises(UserError) as e:
        load_pairs(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and says in str(e.value) and "\n" not in str(e.value)


def test_text_and_conversation_pairs_render_alike_and_only_reply_tokens_carry_the_loss(tmp_path) -> None:
    import json

    from jaxgpt.data.conversations import END, encode_conversation
    from jaxgpt.data.preferences import encode_pair, load_pairs
    from jaxgpt.tasks.rl.rollouts import token_rows

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}) + "\n" + json.dumps(
        {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "chosen": [{"role": "assistant", "content": "5"}],
         "rejected": [{"role": "assistant", "content": "6"}]}) + "\n")
    text, conv = load_pairs(str(path))
    assert (text.prompt, text.chosen, text.rejected) == (conv.prompt, conv.chosen, conv.rejected)
    tok = _tokenizer()
    e = encode_pair(tok, text, 64, 0, "keep_end")
    full = encode_conversation(tok, [*text.prompt, {"role": "assistant", "content": "5"}]).ids.tolist()
    assert e.prompt + e.chosen == full and e.chosen == [*tok.encode("5"), tok.special_ids[END]] and not e.cut
    rows = token_rows([e.prompt], [e.chosen], 20)
    assert rows["mask"].sum() == 2 and (rows["y"][rows["mask"] > 0] == e.chosen).all()  # the reply and its end


def test_a_long_pair_is_cut_prompt_first_as_the_mode_says_and_a_prompt_that_fills_the_context_is_refused() -> None:
    from jaxgpt.data.preferences import Pair, encode_pair
    from jaxgpt.errors import UserError

    tok = _tokenizer()
    pair = Pair([{"role": "user", "content": "abcdefghij"}], "xyz", "xy", "pairs", "p.jsonl:7")
    whole = encode_pair(tok, pair, 100, 0, "keep_end")  # <|user|> 10 <|end|> <|assistant|>: 13; replies 4 and 3
    assert len(whole.prompt) == 13 and not whole.cut
    end = encode_pair(tok, pair, 12, 8, "keep_end")
    start = encode_pair(tok, pair, 12, 8, "keep_start")
    assert end.cut and end.prompt == whole.prompt[-8:] and start.prompt == whole.prompt[:8]
    assert end.chosen == whole.chosen[:4] and end.rejected == whole.rejected  # the room left: 12 - 8
    cut_replies = encode_pair(tok, pair, 15, 0, "keep_end")  # the prompt kept whole, the replies cut to 2
    assert cut_replies.prompt == whole.prompt and cut_replies.chosen == whole.chosen[:2]
    with pytest.raises(UserError, match=r"^p.jsonl:7: the prompt's 13 tokens leave no room"):
        encode_pair(tok, pair, 13, 0, "keep_end")


def test_builtin_pairs_reject_a_close_wrong_answer_and_hold_out_what_sft_holds_out() -> None:
    from jaxgpt.data.conversations import BUILTIN_DATASETS, builtin_conversations, split_held_out
    from jaxgpt.data.preferences import builtin_pairs, split_pairs, wrong_answer
    from jaxgpt.errors import UserError

    pairs = builtin_pairs(3, 400, BUILTIN_DATASETS)
    assert pairs == builtin_pairs(3, 400, BUILTIN_DATASETS)  # a pure function of the seed
    assert all(p.chosen != p.rejected and len(p.rejected) >= 1 for p in pairs)
    assert [p.kind for p in pairs[:4]] == list(BUILTIN_DATASETS)
    rng = np.random.default_rng(0)
    assert {wrong_answer("1", rng) for _ in range(40)} <= {"0", "2", "3"}  # off by 1 or 2, never negative
    assert wrong_answer("b0 a1: 1", rng).startswith("b0 a1: ") and wrong_answer("abc", rng) != "abc"
    _, held = split_pairs(pairs, 0.1)
    _, sft_held = split_held_out(builtin_conversations(3, 400, BUILTIN_DATASETS), 0.1)
    assert [p.prompt for p in held] == [c[:-1] for c in sft_held]
    assert [p.chosen for p in held] == [c[-1]["content"] for c in sft_held]
    with pytest.raises(UserError, match=r"^2 pairs are too few .* change config\.dpo\.val_fraction$"):
        split_pairs(pairs[:2], 0.1)


@pytest.mark.parametrize(("overrides", "says"), [
    ({"loss_type": "kto"}, "loss_type='kto' is unknown"),
    ({"loss_type": "simpo", "reference": "live"}, "uses no reference model"),
    ({"reference": "cached"}, "reference='cached' is unknown"),
    ({"truncation_mode": "middle"}, "truncation_mode='middle' is unknown"),
    ({"beta": 0.0}, "beta=0.0 must be > 0"),
    ({"rpo_alpha": -1.0}, "rpo_alpha=-1.0 and"),
])
def test_bad_dpo_settings_are_one_line(overrides: dict, says: str) -> None:
    from jaxgpt.data.preferences import PreferenceConfig
    from jaxgpt.errors import UserError

    with pytest.raises(UserError, match=re.escape(says)):
        PreferenceConfig(**overrides)
