"""`jaxgpt serve` driven by the official OpenAI client on 127.0.0.1: completions equal `generate`'s, streaming,
concurrent clients of different prompt lengths, bad requests, disconnects and a graceful SIGTERM."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import signal
import sys
import time
import types

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from helpers import serving  # noqa: E402
from helpers.models import CountingDecodes, bpe_or_skip, random_params, save_run  # noqa: E402
from helpers.runs import run as run_command  # noqa: E402
from helpers.server import CFG, CHARS, TOKENIZER, Server  # noqa: E402

from jaxgpt.data.tokenizer import CharTokenizer  # noqa: E402
from jaxgpt.generate import sampling  # noqa: E402
from jaxgpt.generate.many import generate_many  # noqa: E402
from jaxgpt.serve.client import EngineClient  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Server:
    s = Server()
    yield s
    s.close()


def test_completion_equals_generate_alone(server):
    for temperature, top_p in [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)]:
        got = server.client.completions.create(model="tiny", prompt="def main(", max_tokens=20,
                                               temperature=temperature, top_p=top_p, seed=7)
        assert got.choices[0].text == server.expected("def main(", 20, temperature, 7, top_p)
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 20
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert httpx.get(f"http://127.0.0.1:{server.port}/health").json() == {"status": "ok"}


def test_streamed_text_equals_the_plain_completion(server):
    chunks = list(server.client.completions.create(model="tiny", prompt="x = ", max_tokens=25, temperature=1.0,
                                                   seed=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == server.expected("x = ", 25, 1.0, 3)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_list_prompts_n_stop_and_logprobs(server):
    got = server.client.completions.create(model="tiny", prompt=["a", "bc = d"], n=2, max_tokens=12, temperature=1.0,
                                           seed=11, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == server.expected("a", 12, 1.0, 11)
    assert got.choices[1].text == server.expected("a", 12, 1.0, 12)  # choice j samples with seed + j
    assert got.choices[3].text == server.expected("bc = d", 12, 1.0, 12)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    full = server.expected("q", 30, 0.0, 0)
    stop = full[10:12]
    cut = server.client.completions.create(model="tiny", prompt="q", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_choice_decodes_only_what_is_new_and_cuts_stop_strings_across_split_characters():
    """A choice's text grows by what each token adds (ids decoded a bounded number of times, not the whole reply
    again per token), leaves out what the engine marks as end tokens, streams no partial character, is cut at a
    stop string that spans characters split between tokens, and keeps a partial character at its end."""

    from jaxgpt.serve.choices import Choice
    from jaxgpt.serve.metrics import Metrics

    bpe = bpe_or_skip()
    engine = types.SimpleNamespace(state=(0, 0, None))  # what Metrics reads of an engine

    def choice(stops: list[str]) -> tuple[Choice, CountingDecodes]:
        counting = CountingDecodes(bpe)
        return Choice(0, counting, stops, Metrics(engine, 1), time.perf_counter()), counting

    text = "naïve café 🙂 done. " * 50
    ids = bpe.encode(text)
    c, _ = choice(["🙂 done. naïve"])
    streamed = []
    for i, token in enumerate(ids):
        c.add(token, 0.0, [], False)
        if i == 5:
            c.add(bpe.eot_token, 0.0, [], True)
        streamed.append(c.ready())
        c.sent += len(streamed[-1])
        if c.finish_reason is not None:
            break
    assert c.text == "naïve café " and c.finish_reason == "stop" and c.cancelled
    assert "".join(streamed) == c.text and not any("\ufffd" in piece for piece in streamed)
    assert c.generated == i + 2 and len(c.ids) == i + 1 and bpe.eot_token not in c.ids

    c, counting = choice([])
    for token in ids:
        c.add(token, 0.0, [], False)
    cut = bpe.encode("🙂")[:-1]  # a character split between tokens, its last token missing
    for token in cut:
        c.add(token, 0.0, [], False)
    assert counting.decoded < 8 * len(ids)
    c.done("length")
    assert c.text == bpe.decode(ids + cut) and c.text.endswith("\ufffd") and c.finish_reason == "length"


def test_sixteen_concurrent_clients_of_different_lengths(server):
    # three prompt lengths and three budgets, mixed: `generate` (the expected text) compiles per length and budget
    rng = np.random.default_rng(0)
    prompts = ["".join(rng.choice(list(CHARS[1:]), int(n))) for n in rng.choice([2, 9, 23], 16)]
    budgets = [(15, 24, 31)[i % 3] for i in range(16)]

    def ask(i: int) -> tuple[str, str]:
        got = server.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=budgets[i],
                                               temperature=0.9, seed=i)
        return got.choices[0].text, server.expected(prompts[i], budgets[i], 0.9, i)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for got, want in pool.map(ask, range(16)):
            assert got == want


def test_bad_requests_are_400s_and_the_server_keeps_serving(server):
    # values of the wrong type are not coerced (schemathesis's negative examples found `true` taken as token 1)
    bad = [dict(temperature=-1), dict(max_tokens=0), dict(top_p=1.5), dict(extra_body={"bogus": 1}),
           dict(max_tokens=64), dict(logprobs=9), dict(prompt="UPPER"), dict(stop=["a", ""]), dict(prompt=[]),
           dict(prompt=[True, 2]), dict(max_tokens=True), dict(extra_body={"n": "2"})]
    for kwargs in bad:
        args = {"model": "tiny", "prompt": "abc", "max_tokens": 5, **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            server.client.completions.create(**args)
        assert err.value.status_code == 400 and err.value.body["message"], kwargs
    assert httpx.post(f"{server.url.removesuffix('/v1')}/detokenize", json={"tokens": [True]}).status_code == 400
    raw = httpx.post(f"{server.url}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert server.client.completions.create(model="tiny", prompt="ok", max_tokens=3).choices[0].text


def test_a_failing_decode_step_is_a_500_and_the_next_request_is_served(server, monkeypatch):
    def fail() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(server.engine, "_step", fail)
    with pytest.raises(openai.InternalServerError):
        server.client.completions.create(model="tiny", prompt="a", max_tokens=3)
    monkeypatch.undo()
    assert server.client.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=0).choices[0].text


def test_a_front_end_whose_engine_process_ended_fails_its_requests_and_says_so():
    """The engine's end of the pipe closes (its process died): the choice in flight ends in error, the front end is
    told once (`jaxgpt serve`'s shuts down), and a new request is refused with EngineLostError."""
    import asyncio

    from jaxgpt.serve.client import EngineLostError

    async def scenario() -> tuple[list, list[str]]:
        ours, theirs = multiprocessing.Pipe()
        lost: list[str] = []
        client = EngineClient(theirs, "v", on_lost=lambda: lost.append("lost"))
        client.start()
        queue: asyncio.Queue = asyncio.Queue()
        ours.send(({}, (0, 0, "v", 4)))  # the engine's state comes first
        submitted = asyncio.ensure_future(client.submit([({"prompt": [1]}, queue)], False))
        await asyncio.sleep(0.05)
        kind, [(rid, fields, _)] = ours.recv()
        assert (kind, fields) == ("submit", {"prompt": [1]})
        ours.send(({rid: [("queued", True), ("version", "v"), ("token", (5, 0.0, [], False))]}, (0, 1, "v", 4)))
        assert await submitted == [rid] and client.state == (0, 1, "v", 4)
        ours.close()
        events = [await queue.get(), await asyncio.wait_for(queue.get(), 5)]
        with pytest.raises(EngineLostError):
            await client.submit([({"prompt": [1]}, queue)], False)
        client.close()
        return events, lost

    events, lost = asyncio.run(scenario())
    assert events == [[("version", "v"), ("token", (5, 0.0, [], False))], [("done", "lost")]] and lost == ["lost"]


def test_disconnect_mid_stream_frees_the_slot():
    one = Server(slots=1, max_waiting=4)
    try:
        with httpx.stream("POST", f"{one.url}/completions", json={"prompt": "a", "max_tokens": 60, "stream": True,
                                                                  "temperature": 1.0}, timeout=60) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ")
        # The only slot was the streaming request's: the next request is served once it is freed.
        got = one.client.completions.create(model="tiny", prompt="b", max_tokens=5, temperature=0)
        assert got.choices[0].text == one.expected("b", 5, 0.0, 0)
    finally:
        one.close()


def test_full_queue_is_a_429(monkeypatch):
    busy = Server(slots=1, max_waiting=0)
    step = busy.engine._step
    monkeypatch.setattr(busy.engine, "_step", lambda: (time.sleep(0.2), step()))  # the stream holds its slot 1.6 s
    try:
        with httpx.stream("POST", f"{busy.url}/completions", json={"prompt": "a", "max_tokens": 60, "stream": True},
                          timeout=60) as response:
            assert '"choices"' in next(response.iter_lines())  # taken: the one slot is free
            with pytest.raises(openai.RateLimitError):
                busy.client.completions.create(model="tiny", prompt="b", max_tokens=5)
    finally:
        busy.close()


def test_serve_command_finishes_requests_in_flight_on_sigterm(tmp_path):
    """With two HTTP front ends, each finishes its requests in flight before the engine's process exits. Also: the
    run's chat_template.jinja serves chat, JAXGPT_API_KEY guards the server, and --max_model_len caps a request's
    positions (a 400 past it; /v1/models says it), where a value past the model's context is one line at start."""
    run = save_run(tmp_path / "run", CFG, random_params(CFG), TOKENIZER.to_meta())
    (run / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    log = tmp_path / "stderr.txt"
    refused = run_command([sys.executable, "-m", "jaxgpt", "serve", f"--workdir={run}", "--max_model_len=65"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --max_model_len=65 is past the model's context of 64: give at most that, or leave it out"]
    with serving(f"--workdir={run}", "--api_servers=2", "--max_model_len=48", log=log,
                 env={"JAX_PLATFORMS": "cpu", "JAXGPT_API_KEY": "k"}) as (proc, url):
        assert httpx.get(f"{url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=60)
        assert client.models.list().data[0].model_extra["max_model_len"] == 48
        with pytest.raises(openai.BadRequestError, match="plus max_tokens=46 exceed the model's context of 48"):
            client.completions.create(model="run", prompt="abc", max_tokens=46, temperature=0)
        chat = client.chat.completions.create(model="run", messages=[{"role": "user", "content": "abc"}],
                                              max_tokens=3, temperature=0)
        assert len(chat.choices[0].message.content) == 3
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # new connections: the kernel spreads them
            answers = [pool.submit(client.completions.create, model="run", prompt="abc", max_tokens=40,
                                   temperature=0) for _ in range(4)]
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            assert [len(a.result().choices[0].text) for a in answers] == [40] * 4  # finished whole after the signal
        assert proc.wait(timeout=60) == 0
    assert "Traceback" not in log.read_text()


def test_sample_prompt_file_completes_ragged_requests_as_each_alone(tmp_path, capsys):
    from jaxgpt.commands import sample as sample_command

    params = random_params(CFG)
    run = save_run(tmp_path / "run", CFG, params, TOKENIZER.to_meta())
    rng = np.random.default_rng(4)
    prompts = ["".join(rng.choice(list(CHARS[1:]), int(n))) for n in rng.choice([3, 17], 7)]  # few shapes to compile
    lines = [{"prompt": p, "max_tokens": (10, 14)[i % 2], "seed": i, "temperature": 0.0 if i % 3 == 0 else 0.9}
             for i, p in enumerate(prompts)]
    alone = lambda r: TOKENIZER.decode(sampling.generate(
        params, CFG, TOKENIZER.encode(r["prompt"]), max_new_tokens=r["max_tokens"], key=r["seed"],
        temperature=r["temperature"])[0].tolist())
    stop = alone(lines[0])[4:6]
    lines.append({**lines[0], "stop": stop})
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert sample_command.main(["jaxgpt sample", f"--workdir={run}", f"--prompt_file={path}", "--batch_size=3"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["prompt"] for o in out] == [r["prompt"] for r in lines]
    for o, r in zip(out[:-1], lines[:-1], strict=True):
        assert o["completion"] == alone(r) and o["finish_reason"] == "length" and o["tokens"] == r["max_tokens"]
    full = alone(lines[0])
    assert out[-1]["completion"] == full[:full.find(stop)] and out[-1]["finish_reason"] == "stop"

    path.write_text(json.dumps(lines[0]) + "\n" + '{"prompt": "a", "max_tokens": "many"}\n')
    assert sample_command.main(["jaxgpt sample", f"--workdir={run}", f"--prompt_file={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "requests.jsonl:2" in err and "max_tokens" in err


def test_engine_decodes_encoder_decoder_sources_of_different_lengths_as_each_alone():
    """The source is the prompt: each slot holds its source's encoding; every row equals seq2seq decoding of its
    source alone (greedy and seeded)."""
    import jax
    from helpers.seq2seq import BOS, PAD, tiny
    from helpers.seq2seq import random_params as seq2seq_params

    from jaxgpt.generate import seq2seq as dec

    cfg = tiny()
    params = seq2seq_params(cfg)
    rng = np.random.default_rng(5)
    sources = [rng.integers(PAD + 1, cfg.src_vocab_size, int(n)).tolist() for n in rng.integers(1, 10, 6)]
    eos = 2
    settings = [(0.0, 0), (1.0, 3), (0.7, 4), (0.0, 1), (1.2, 9), (1.0, 5)]
    got = generate_many(params, cfg, sources, max_new_tokens=cfg.model.block_size, seeds=[s for _, s in settings],
                        temperature=[t for t, _ in settings], slots=4,
                        specials=dict(pad_id=PAD, bos_id=BOS, eos_id=eos))
    for src, (temperature, seed), tokens in zip(sources, settings, got, strict=True):
        src_1S = np.array([src], np.int32)
        if temperature == 0:
            want = dec.greedy(params, cfg, src_1S, bos_id=BOS, eos_id=eos, max_new_tokens=cfg.model.block_size)
        else:
            want = dec.sample(params, cfg, src_1S, bos_id=BOS, eos_id=eos, max_new_tokens=cfg.model.block_size,
                              key=jax.random.key(seed), temperature=temperature)
        want = np.asarray(want)[0].tolist()
        assert tokens == want[:len(tokens)] and (len(tokens) == len(want) or tokens[-1] == eos)


def test_serving_an_encoder_decoder_takes_the_source_as_the_prompt():
    from helpers.seq2seq import random_params as seq2seq_params
    from helpers.seq2seq import tiny

    from jaxgpt.data.pairs import SPECIALS, PairText, decode_ids, encode_text
    from jaxgpt.generate import seq2seq as dec

    cfg, chars = tiny(), CharTokenizer("abcdefgh")
    params = seq2seq_params(cfg)
    served = Server(model=(params, cfg, PairText(chars, SPECIALS), SPECIALS))
    try:
        for source in ["abc", "hgfedcba", "d"]:
            got = served.client.completions.create(model="tiny", prompt=source, max_tokens=cfg.model.block_size,
                                                   temperature=0)
            want = dec.greedy(params, cfg, np.array([encode_text(chars, SPECIALS, source)], np.int32),
                              bos_id=SPECIALS["bos_id"], eos_id=SPECIALS["eos_id"], max_new_tokens=cfg.model.block_size)
            assert got.choices[0].text == decode_ids(chars, SPECIALS, np.asarray(want)[0])
        with pytest.raises(openai.BadRequestError):  # longer than src_block_size
            served.client.completions.create(model="tiny", prompt="abcdefghab", max_tokens=3)
    finally:
        served.close()
