"""Chat fine-tuning: conversation files, the chat format and its template, the loss mask (SFT on the loop:
tests/integration/test_chat_runs.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiktoken
from helpers.chat import ALPHABET, render

from jaxgpt.data.batches import batch_indices
from jaxgpt.data.conversations import (
    MAX_OPERAND,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    builtin_conversations,
    chat_tokenizer,
    encode_conversation,
    fit_context,
    load_jsonl,
    pack_rows,
    split_held_out,
    to_rows,
)
from jaxgpt.data.tokenizer import EOT_TEXT, CharTokenizer, WordTokenizer, load_bpe, tokenizer_from_meta
from jaxgpt.errors import UserError
from jaxgpt.io.weights import grow_vocab
from jaxgpt.model.config import ModelConfig
from jaxgpt.model.gpt import GPT, init_params
from jaxgpt.tasks.chat import chat_loss


def test_loss_mask_covers_exactly_the_assistant_tokens_of_a_hand_checked_conversation() -> None:
    tok = chat_tokenizer(CharTokenizer("abchikoxyz"))
    s, u, a, e = (tok.special_ids[t] for t in SPECIAL_TOKENS)
    assert (s, u, a, e) == (10, 11, 12, 13)
    c = tok.base.encode
    conv = [{"role": "system", "content": "b"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": "yz"}]
    enc = encode_conversation(tok, conv)
    expected = [s, *c("b"), e, u, *c("hi"), e, a, *c("ok"), e, u, *c("x"), e, a, *c("yz"), e]
    assert enc.ids.tolist() == expected
    #            <s> b  e  <u> h  i  e  <a> o  k  e  <u> x  e  <a> y  z  e
    assistant = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert enc.assistant.astype(int).tolist() == assistant
    assert enc.answer.astype(int).tolist() == [0] * 15 + [1, 1, 1]
    assert enc.turn_ends == (11, 18)
    rows = to_rows([enc], width=20)
    assert rows["x"][0, :17].tolist() == expected[:-1] and rows["y"][0, :17].tolist() == expected[1:]
    assert rows["loss_mask"][0].astype(int).tolist() == assistant[1:] + [0] * 3  # targets: shifted by one
    # The loss is the mean over exactly those targets: logits right only there give zero loss whatever elsewhere.
    logits_BWV = np.where(np.eye(tok.vocab_size)[rows["y"]] > 0, 0.0, -30.0)
    logits_BWV = np.where(rows["loss_mask"][..., None] > 0, logits_BWV, np.random.default_rng(0).normal(
        size=logits_BWV.shape))
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    assert float(chat_loss(jnp.asarray(logits_BWV), batch)) < 1e-10


def test_padding_after_a_conversation_changes_nothing_it_is_trained_on() -> None:
    """One conversation per row, right-padded: what fills the padding changes neither the loss nor its gradient."""
    tok = chat_tokenizer(CharTokenizer(ALPHABET))
    cfg = ModelConfig(vocab_size=tok.vocab_size, block_size=80, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    params = init_params(cfg, jax.random.key(0), model)
    rows = to_rows([encode_conversation(tok, c) for c in builtin_conversations(1, 4)], width=80)
    junk = {**rows}
    pad_BW = np.cumsum(rows["loss_mask"][:, ::-1], 1)[:, ::-1] == 0  # after each row's last target
    junk["x"] = np.where(pad_BW, np.random.default_rng(1).integers(0, cfg.vocab_size, pad_BW.shape), rows["x"])
    junk["y"] = np.where(pad_BW, np.random.default_rng(2).integers(0, cfg.vocab_size, pad_BW.shape), rows["y"])
    assert pad_BW.any() and not np.array_equal(junk["x"], rows["x"])
    grad = jax.jit(jax.value_and_grad(lambda p, b: chat_loss(model.apply({"params": p}, b["x"]), b)))
    (l1, g1), (l2, g2) = grad(params, rows), grad(params, junk)
    assert float(l1) == float(l2)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)


def test_packing_is_deterministic_and_holds_every_train_conversation_once() -> None:
    # longest first, each into the row it leaves the least room in: 5 -> row 0 (1 left), 4 -> row 1 (2 left),
    # 3 -> row 2 (3 left), 2 -> row 1 (the fullest with room), 1 -> row 0
    assert pack_rows([3, 5, 2, 4, 1], 6) == [[1, 4], [3, 2], [0]]
    tok = chat_tokenizer(CharTokenizer(ALPHABET))
    lengths = [len(encode_conversation(tok, c).ids) for c in builtin_conversations(2, 400)]
    plan = pack_rows(lengths, max(lengths))
    assert plan == pack_rows(list(lengths), max(lengths))
    assert sorted(i for row in plan for i in row) == list(range(400))  # each exactly once
    assert all(sum(lengths[i] for i in row) <= max(lengths) for row in plan) and len(plan) < 0.7 * 400


def test_packed_rows_hold_each_conversation_whole_and_train_on_what_one_per_row_does() -> None:
    """Every packed conversation's ids, segment and loss mask are its own (the mask exactly its assistant tokens,
    the target after one conversation's end token not counted), and the model's loss over packed rows is the loss
    over one conversation per row."""
    tok = chat_tokenizer(CharTokenizer(ALPHABET))
    encoded = [encode_conversation(tok, c) for c in builtin_conversations(3, 40)]
    W = max(len(e.ids) for e in encoded) - 1
    plan = pack_rows([len(e.ids) for e in encoded], W + 1)
    rows = to_rows(encoded, W, plan)
    assert max(len(row) for row in plan) == 3 and set(rows) == {"x", "y", "loss_mask", "answer_mask", "segments"}
    for n, row in enumerate(plan):  # a row's W + 1 ids, and per id whether it is a target the loss counts
        ids, counted = np.append(rows["x"][n, :1], rows["y"][n]), np.append(0.0, rows["loss_mask"][n])
        start = 0
        for segment, i in enumerate(row, 1):
            end = start + len(encoded[i].ids)
            assert ids[start:end].tolist() == encoded[i].ids.tolist()
            assert counted[start:end].tolist() == encoded[i].assistant.tolist()
            assert (rows["segments"][n, start:min(end, W)] == segment).all()
            start = end
        assert not ids[start:].any() and not counted[start:].any() and not rows["segments"][n, start:].any()
    cfg = ModelConfig(vocab_size=tok.vocab_size, block_size=W, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    params = init_params(cfg, jax.random.key(0), model)
    single = to_rows(encoded, W)
    assert rows["loss_mask"].sum() == single["loss_mask"].sum()  # the same tokens, so means compare
    loss = jax.jit(lambda b, seg: chat_loss(model.apply({"params": params}, b["x"], segments_BT=seg), b))
    np.testing.assert_allclose(float(loss(rows, rows["segments"])), float(loss(single, None)), rtol=1e-5)


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_template_rendered_and_encoded_gives_the_python_side_ids(kind: str) -> None:
    base = {"char": lambda: CharTokenizer(ALPHABET),
            "word": lambda: WordTokenizer(["what", "is", "spell", "backwards", "hello", "'", "?", "."]),
            "bpe": load_bpe}[kind]()
    tok = tokenizer_from_meta(chat_tokenizer(base).to_meta())  # as the server rebuilds it from the run
    conversations = [*builtin_conversations(3, 12), [
        {"role": "user", "content": "Spell 'hello' backwards."}, {"role": "assistant", "content": "olleh"},
        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]]
    for conv in conversations:
        enc = encode_conversation(tok, conv)
        assert tok.encode(render(conv)) == enc.ids.tolist()
        prompt = tok.encode(render(conv[:-1], add_generation_prompt=True))  # what the server feeds the model
        assert prompt == enc.ids[:len(prompt)].tolist() and prompt[-1] == tok.special_ids[ROLE_TOKENS["assistant"]]
        assert enc.answer[len(prompt):].all() and not enc.answer[:len(prompt)].any()
        if kind != "word":  # words decode to their standardized text
            assert tok.decode(enc.ids.tolist()) == render(conv)
    if kind == "bpe":  # the same ids as tiktoken's own special tokens
        raw = base._encoding
        enc = tiktoken.Encoding("chat", pat_str=raw._pat_str, mergeable_ranks=raw._mergeable_ranks,
                                special_tokens={EOT_TEXT: 50256, **tok.special_ids})
        text = render(conversations[-1]) + EOT_TEXT
        assert tok.encode(text) == enc.encode(text, allowed_special="all")


@pytest.mark.parametrize(("line", "message"), [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}]}', "out of order"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, '
     '{"role": "assistant", "content": "c"}]}', "out of order"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
     '{"role": "user", "content": "c"}]}', "last turn is not the assistant's"),
    ('{"messages": [{"role": "user", "content": "a<|end|>"}, {"role": "assistant", "content": "b"}]}',
     "special token"),
    ('{"messages": []}', '"messages" list'),
])
def test_a_malformed_conversation_is_one_line_naming_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(UserError, match=f"^{path}:3: .*{message}") as info:
        load_jsonl(path)
    assert "\n" not in str(info.value)
    path.write_text(f"{good}\n\n{good}\n")
    assert [where for where, _ in load_jsonl(path)] == [f"{path}:1", f"{path}:3"]


def test_long_conversations_are_cut_at_a_turn_boundary_or_dropped() -> None:
    tok = chat_tokenizer(CharTokenizer(ALPHABET))
    conv = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"},
            {"role": "user", "content": "f"}, {"role": "assistant", "content": "ghij"}]
    enc = encode_conversation(tok, conv)  # turns end at 9 and 18 tokens
    assert fit_context(enc, 18) is enc
    cut = fit_context(enc, 17)
    assert cut.ids.tolist() == enc.ids[:9].tolist() and cut.turn_ends == (9,)
    assert cut.answer.astype(int).tolist() == [0] * 6 + [1] * 3  # the kept last turn is now the answer
    assert fit_context(enc, 8) is None


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    a, b = builtin_conversations(7, 200), builtin_conversations(7, 200)
    assert a == b and a != builtin_conversations(8, 200)
    assert {len(c) for c in a} == {2, 3}  # the fact task has a system message
    assert np.array_equal(batch_indices(7, 5, 200, 16), batch_indices(7, 5, 200, 16))


def test_builtin_answers_are_right_and_held_out_prompts_are_new_to_training() -> None:
    """Every built-in answer is checked by recomputing it; held-out reverse and count strings, fact names and
    arithmetic operand pairs never occur in training, so held-out exact match measures the skill, not recall."""
    conversations = builtin_conversations(0, 4000)
    assert set("".join(m["content"] for c in conversations for m in c)) <= set(ALPHABET)
    train, val = split_held_out(conversations, 0.05)
    subjects: dict[str, list[set[str]]] = {}
    for part, split in ((0, train), (1, val)):
        for c in split:
            question, answer = c[-2]["content"], c[-1]["content"]
            if question.startswith("Spell"):
                word = question.split("'")[1]
                assert answer == word[::-1] and 3 <= len(word) <= 6
                kind, subject = "reverse", word
            elif question.startswith("How many"):
                letter, word = question.split("'")[1::2]
                tally, total = answer.split(": ")  # each letter with the count so far, then the total
                assert tally.split() == [f"{c}{word[:i + 1].count(letter)}" for i, c in enumerate(word)]
                assert total == str(word.count(letter))
                kind, subject = "count", word
            elif c[0]["role"] == "system":
                name = question.removeprefix("What is ").split("'")[0]
                assert c[0]["content"].startswith(f"{name}'s ") and c[0]["content"] == f"{question[8:-1]} is {answer}."
                kind, subject = "fact", name
            else:
                a, op, b = question.removeprefix("What is ").removesuffix("?").split()
                assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
                assert max(int(a), int(b)) <= MAX_OPERAND
                kind, subject = "arithmetic", question
            subjects.setdefault(kind, [set(), set()])[part].add(subject)
    assert set(subjects) == {"arithmetic", "reverse", "count", "fact"}
    counts = [c[-1]["content"].split(": ")[1] for c in conversations if c[-2]["content"].startswith("How many")]
    assert max(counts.count(k) for k in "0123") < 0.3 * len(counts)  # no one answer scores well by itself
    for kind, (seen, held) in subjects.items():
        assert held and len(held & seen) <= len(held) // 20, kind  # random strings: a rare repeat at most


def test_new_tokens_grow_the_table_and_leave_existing_rows() -> None:
    params = {"wte": {"embedding": np.arange(12, dtype=np.float32).reshape(4, 3)},
              "lm_head": {"kernel": np.ones((3, 4), np.float32), "bias": np.zeros(4, np.float32)}}
    grown = grow_vocab(params, 6, 0)
    assert grown["wte"]["embedding"].shape == (6, 3) and grown["lm_head"]["kernel"].shape == (3, 6)
    assert np.array_equal(grown["wte"]["embedding"][:4], params["wte"]["embedding"])
    assert np.allclose(grown["lm_head"]["kernel"][:, 4:], 1.0) and grown["lm_head"]["bias"].shape == (6,)
    assert not np.allclose(grown["wte"]["embedding"][4], grown["wte"]["embedding"][5])
