"""The engine's speed-ups keep its answers: several tokens per dispatch with per-slot ends (end-of-text, stop ids,
max_new_tokens), only the busy slots decoded (power-of-two rows), everything compiled before the first request
(`warm_up`), a cancel honoured at once, and a chat reply
through the server ending at the chat's end-of-turn token, which stays out of its text."""

from __future__ import annotations

import jax
import pytest

from jaxgpt.errors import UserError
from jaxgpt.generate import engine as engine_module
from jaxgpt.generate import sampling
from jaxgpt.generate.engine import Engine, Request
from jaxgpt.generate.slots import decode_chunk, move_slot, prefill_slots

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("jinja2")

from helpers.models import random_params  # noqa: E402
from helpers.server import CFG, TOKENIZER, Server  # noqa: E402

from jaxgpt.data.conversations import ChatTemplate  # noqa: E402

PARAMS = random_params(CFG)
PROMPTS = [TOKENIZER.encode(p) for p in ("def f(", "a", "x = (a, b)\nprint(x", "import os\n")]


def alone(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    return sampling.generate(PARAMS, CFG, prompt, max_new_tokens=n, key=seed, temperature=temperature)[0].tolist()


def run(requests: list[Request], slots: int = 4, chunk: int = 3, **options: object) -> Engine:
    engine = Engine(PARAMS, CFG, slots=slots, chunk=chunk, **options)
    for r in requests:
        engine.submit(r)
    engine.drain()
    return engine


def collecting(prompt: list[int], n: int, **settings: object) -> tuple[Request, list[int], list[str]]:
    tokens: list[int] = []
    reasons: list[str] = []
    request = Request(prompt, n, emit=lambda t, *_: tokens.append(t), done=reasons.append, **settings)
    return request, tokens, reasons


def test_chunks_of_ragged_requests_give_each_its_tokens_alone_and_its_end():
    """Lengths that are no multiple of the chunk, a request for one token, stop ids and end-of-text ending
    slots mid-chunk, more requests than slots: each gets `generate`'s tokens for its prompt alone, up to its end."""
    full = alone(PROMPTS[0], 12, 1.0, 7)
    stop = next(t for i, t in enumerate(full) if i >= 4 and t not in full[:i])
    eot = alone(PROMPTS[2], 6)[3]
    cases = [collecting(PROMPTS[0], 12, temperature=1.0, seed=7, stop_ids=[stop]),
             collecting(PROMPTS[1], 1, temperature=0.0), collecting(PROMPTS[2], 9, temperature=0.0),
             collecting(PROMPTS[3], 10, temperature=0.7, seed=3), collecting(PROMPTS[1], 5, temperature=1.0, seed=1),
             collecting(PROMPTS[2], 9, temperature=0.0, ignore_eos=True)]
    run([r for r, _, _ in cases], eot_token=eot)
    cut = full.index(stop) + 1
    want_eot = alone(PROMPTS[2], 9)
    assert cases[0][1:] == (full[:cut], ["stop"])
    assert cases[1][1:] == (alone(PROMPTS[1], 1), ["length"])
    assert cases[2][1:] == (want_eot[:want_eot.index(eot) + 1], ["stop"])
    assert cases[3][1:] == (alone(PROMPTS[3], 10, 0.7, 3), ["length"])
    assert cases[4][1:] == (alone(PROMPTS[1], 5, 1.0, 1), ["length"])
    assert cases[5][1:] == (want_eot, ["length"])


def spy_on_chunks(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments (rows, span, ...) of every decode chunk that engines made from now on dispatch."""
    calls: list[dict] = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return decode_chunk(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode_chunk", spy)
    return calls


def test_only_the_busy_slots_decode_in_power_of_two_rows(monkeypatch):
    calls = spy_on_chunks(monkeypatch)
    one, tokens, _ = collecting(PROMPTS[0], 7, temperature=0.0)
    run([one], slots=8, chunk=4)
    rows = [c["rows"] for c in calls]
    assert tokens == alone(PROMPTS[0], 7) and set(rows) == {1} and len(rows) <= 3  # 2 chunks (+1 dispatched ahead)
    calls.clear()
    three = [collecting(p, 6, temperature=0.0) for p in PROMPTS[:3]]
    run([r for r, _, _ in three], slots=8, chunk=4)
    assert max(c["rows"] for c in calls) == 4
    assert all(t == alone(p, 6) for (_, t, _), p in zip(three, PROMPTS, strict=False))


def test_the_prompts_admitted_together_are_prefilled_in_one_call_a_bucket(monkeypatch):
    """A tick's prompts of one bucket share one prefill call, in a power of two of rows whose padding row writes
    no slot (here it would leave a free slot started, one that no chunk decodes); a prompt that asks for its
    log-probabilities has a call of its own; each request gets `generate`'s tokens for its prompt alone."""
    calls: list[tuple[tuple[int, int], bool]] = []

    def spy(*args, **kwargs):
        calls.append((args[3].shape, kwargs["score"]))
        return prefill_slots(*args, **kwargs)

    monkeypatch.setattr(engine_module, "prefill_slots", spy)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]]  # 18 tokens, then three of 3 or fewer
    cases = [collecting(p, 6, temperature=float(i % 2), seed=i) for i, p in enumerate(prompts)]
    engine = run([r for r, _, _ in cases], slots=6)
    assert calls == [((1, 32), False), ((4, 16), False)]
    assert [t for _, t, _ in cases] == [alone(p, 6, float(i % 2), i) for i, p in enumerate(prompts)]
    assert engine.state.done_S.all()  # every slot free again, the one past the 4 busy ones too
    calls.clear()
    scored: list = []
    cases = [collecting(PROMPTS[3], 6, temperature=0.0, prompt_logprobs=scored.append),
             collecting(PROMPTS[3], 6, temperature=0.0)]
    run([r for r, _, _ in cases], slots=4)
    assert calls == [((1, 16), True), ((1, 16), False)]
    assert [t for _, t, _ in cases] == [alone(PROMPTS[3], 6)] * 2
    assert len(scored) == 1 and len(scored[0]) == len(PROMPTS[3]) - 1


def test_chunks_attend_over_the_span_their_rows_fill_and_a_reused_slot_sees_none_of_its_past(monkeypatch):
    """A chunk reads the power of two of cache positions its busy rows fill by its end, not the whole context:
    requests that cross from one span into the next, and a short request in a slot a longer one had filled
    (the prefill writes only its prompt's positions), each get `generate`'s tokens for their prompt alone."""
    monkeypatch.setattr(sampling, "SHORTEST_CACHE", 8)  # spans 8, 16, 32, 64 on the 64-position test model
    calls = spy_on_chunks(monkeypatch)
    long_, short = PROMPTS[2], PROMPTS[1]  # 18 and 1 tokens
    cases = [collecting(long_, 40, temperature=1.0, seed=5), collecting(short, 20, temperature=0.0),
             collecting(short, 6, temperature=0.0)]  # the third takes the second's slot
    run([r for r, _, _ in cases], slots=2, chunk=4)
    spans = [(c["rows"], c["span"]) for c in calls]
    assert {span for _, span in spans} == {32, 64}  # the long request crosses from one span into the next
    assert spans[0] == (2, 32)  # 18 + 4 positions of the long prompt, 1 + 4 of the short one
    want = [alone(long_, 40, 1.0, 5), alone(short, 20), alone(short, 6)]
    assert [tokens for _, tokens, _ in cases] == want


def test_slots_of_fewer_positions_answer_as_the_whole_context_and_a_move_copies_what_was_written(monkeypatch):
    """`positions` sizes every slot's cache (`generate_many` gives its requests' own, not the model's context):
    requests that fit get `generate`'s tokens, one that would write past them is refused, and a freed slot takes
    only the positions its new request wrote (copying every position cost more than decoding at an 8k context)."""
    monkeypatch.setattr(sampling, "SHORTEST_CACHE", 8)
    moves: list[int] = []

    def spy(state, src, dst, *, span):
        moves.append(span)
        return move_slot(state, src, dst, span=span)

    monkeypatch.setattr(engine_module, "move_slot", spy)
    cases = [collecting(PROMPTS[2], 10, temperature=0.0), collecting(PROMPTS[1], 3, temperature=0.0),
             collecting(PROMPTS[0], 12, temperature=1.0, seed=2)]  # the third takes a freed slot
    engine = run([r for r, _, _ in cases], slots=2, chunk=3, positions=30)
    assert {leaf.shape[-2] for leaf in jax.tree.leaves(engine.state.cache)} == {32}  # 30 to a power of two
    assert [tokens for _, tokens, _ in cases] == [alone(PROMPTS[2], 10), alone(PROMPTS[1], 3),
                                                  alone(PROMPTS[0], 12, 1.0, 2)]
    assert len(moves) == 3 and min(moves) < 32  # the short request's slot: 8 positions of the 32
    with pytest.raises(UserError, match="writes 33 cache positions, past the engine's 32"):
        engine.check(PROMPTS[2], 16, 0.0, 1.0)  # 18 prompt positions and 15 fed tokens


def test_an_encoder_decoder_warms_up_the_spans_of_its_decoder_not_of_its_sources(monkeypatch):
    """An encoder-decoder's decoder starts from bos whatever its source's length: `warm_up` compiles the spans
    that max_new_tokens fill after that one position, not those after the longest source."""
    from helpers.seq2seq import BOS, PAD, tiny
    from helpers.seq2seq import random_params as encdec_params

    monkeypatch.setattr(sampling, "SHORTEST_CACHE", 2)
    calls = spy_on_chunks(monkeypatch)
    cfg = tiny()  # sources of up to 9 tokens, a decoder context of 8
    engine = Engine(encdec_params(cfg), cfg, slots=2, specials={"pad_id": PAD, "bos_id": BOS, "eos_id": 2})
    engine.warm_up(prompt_lengths=[cfg.src_block_size], max_new_tokens=3)
    assert {c["span"] for c in calls} == {2, 4}  # bos + 3 new tokens: 4 positions at most, never the whole context of 8


def test_a_warmed_up_engine_compiles_nothing_more_and_answers_as_a_cold_one():
    """`warm_up` compiles every row count's chunk, every prompt bucket's prefills and the move that frees a slot:
    requests of any count and prompt length afterwards compile nothing (on a GPU each first use stalled the busy
    requests; on a CPU the first freed slot's compile cut one request's tokens/s several-fold); it leaves no trace in
    what they get."""
    cases = [collecting(p, 5 + i, temperature=float(i % 2), seed=i, logprobs=False) for i, p in enumerate(PROMPTS)]
    programs = (engine_module.decode_chunk, engine_module.prefill_slots, engine_module.move_slot)
    for program in programs:  # what other tests compiled would hide what the warm-up leaves out
        program.clear_cache()
    engine = Engine(PARAMS, CFG, slots=4, chunk=3)
    engine.warm_up()
    compiled = [p._cache_size() for p in programs]
    for r, _, _ in cases:
        engine.submit(r)
    engine.drain()
    assert [p._cache_size() for p in programs] == compiled
    for i, (_, tokens, reasons) in enumerate(cases):
        assert (tokens, reasons) == (alone(PROMPTS[i], 5 + i, float(i % 2), i), ["length"])


def test_a_tokenizer_smaller_than_the_model_vocabulary_bounds_the_picks_as_generate_does():
    """`vocab_limit` is the tokenizer's size: below the model's (padded) vocabulary it limits the picks exactly as
    `generate`'s does; at the model's size it limits nothing and is dropped."""
    limit = CFG.vocab_size // 2
    request, tokens, _ = collecting(PROMPTS[0], 8, temperature=1.0, seed=5)
    run([request], slots=1, vocab_limit=limit)
    want = sampling.generate(PARAMS, CFG, PROMPTS[0], max_new_tokens=8, key=5, temperature=1.0, vocab_limit=limit)
    assert tokens == want[0].tolist() and max(tokens) < limit
    assert Engine(PARAMS, CFG, slots=1, vocab_limit=CFG.vocab_size).vocab_limit is None


def test_a_cancel_stops_the_tokens_at_once_and_frees_the_slot():
    tokens: list[int] = []
    reasons: list[str] = []

    def emit(token: int, *_: object) -> None:
        tokens.append(token)
        if len(tokens) == 2:
            request.cancelled = True

    request = Request(PROMPTS[0], 20, emit=emit, done=reasons.append, temperature=0.0)
    after, after_tokens, after_reasons = collecting(PROMPTS[1], 4, temperature=0.0)
    engine = run([request, after], slots=1, chunk=8)
    assert (tokens, reasons) == (alone(PROMPTS[0], 2), ["cancelled"])
    assert (after_tokens, after_reasons) == (alone(PROMPTS[1], 4), ["length"]) and not any(engine.active)


def test_a_chat_reply_ends_at_the_end_of_turn_token_which_is_not_in_its_text():
    text = "user: hi\nassistant:"
    full = TOKENIZER.decode(alone(TOKENIZER.encode(text), 20))
    at = next(i for i, c in enumerate(full) if i >= 3 and c not in full[:i])
    end_id = TOKENIZER.encode(full[at])[0]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    server = Server(chat_template=ChatTemplate(template), chat_stop_ids=[end_id])
    try:
        messages = [{"role": "user", "content": "hi"}]
        got = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (full[:at], "stop")
        assert got.usage.completion_tokens == at + 1  # the end token was generated, and counted
        chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                            temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:at]
        assert chunks[-1].choices[0].finish_reason == "stop"
        plain = server.client.completions.create(model="tiny", prompt=text, max_tokens=20, temperature=0)
        assert plain.choices[0].text == full  # completions do not stop there
    finally:
        server.close()
