"""`jaxgpt serve` as the ecosystem's clients use it, on 127.0.0.1: the openai client's completions and chat
completions (plain, streamed with usage, n, stop, seed, logprobs), prompts as token ids, echo with the prompt's
log-probabilities (equal to the scorer's), logit_bias and ignore_eos, vLLM's tokenizer endpoints, the API key,
the body limit, /metrics through prometheus-client's parser and the statuses the OpenAPI document declares."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("jinja2")

from helpers.server import CFG, KEY, TEMPLATE, TOKENIZER, Server  # noqa: E402

from jaxgpt.data.conversations import ChatTemplate, load_template  # noqa: E402
from jaxgpt.errors import UserError  # noqa: E402
from jaxgpt.evals.loglik import Scorer  # noqa: E402
from jaxgpt.generate.engine import Engine, Request  # noqa: E402
from jaxgpt.generate.many import generate_many  # noqa: E402

LIMIT = 16_384  # bytes of a request body


@pytest.fixture(scope="module")
def server() -> Server:
    s = Server(api_key=KEY, chat_template=ChatTemplate(TEMPLATE), max_body_bytes=LIMIT)
    yield s
    s.close()


def alone(server: Server, prompt: str, max_tokens: int, temperature: float, seed: int) -> str:
    """What the engine alone samples for the prompt (tests/integration/serve/test_serve.py shows it is `generate`'s
    sample); with the server's slot count it reuses the server's compiled programs, so it costs no compile."""
    tokens = generate_many(server.params, CFG, [TOKENIZER.encode(prompt)], max_new_tokens=max_tokens, seeds=seed,
                           temperature=temperature, slots=server.engine.n_slots)[0]
    return TOKENIZER.decode(tokens)


def root(server: Server, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def test_prompts_as_token_ids_user_and_usage_in_the_last_streamed_chunk(server):
    ids = TOKENIZER.encode("def f(")
    one = server.client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0.9, seed=2,
                                           user="someone")
    assert one.choices[0].text == alone(server, "def f(", 8, 0.9, 2)
    assert one.usage.prompt_tokens == len(ids) and one.usage.completion_tokens == 8
    many = server.client.completions.create(model="tiny", prompt=[ids, TOKENIZER.encode("x")], max_tokens=5,
                                            temperature=0, seed=0)
    assert [c.text for c in many.choices] == [alone(server, "def f(", 5, 0.0, 0), alone(server, "x", 5, 0.0, 0)]
    chunks = list(server.client.completions.create(model="tiny", prompt="ab", max_tokens=6, n=2, seed=4,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 4 and all(c.usage is None for c in chunks[:-1])
    running = list(server.client.completions.create(  # vLLM's continuous_usage_stats: the usage so far, each chunk
        model="tiny", prompt="ab", max_tokens=6, seed=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running]
    assert counts[-2:] == [6, 6] and all(c.usage.prompt_tokens == 2 for c in running)
    brought = [b - a for a, b in zip([0, *counts[:-2]], counts[:-1], strict=True)]  # one character per token here
    assert [len(c.choices[0].text) for c in running[:-1]] == brought
    V = len(TOKENIZER.chars)
    with pytest.raises(openai.BadRequestError, match=rf"token ids \[{V}\] are outside the vocabulary \[0, {V}\)"):
        server.client.completions.create(model="tiny", prompt=[[0, V]], max_tokens=2)


def test_echo_gives_the_prompt_logprobs_the_scorer_gives(server):
    prompt = "x = (a, b)"
    ids = TOKENIZER.encode(prompt)
    for max_tokens in (0, 3):
        got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               echo=True, logprobs=2)
        choice = got.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        assert "".join(lp.tokens) == choice.text and lp.text_offset[1] == 1
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == max_tokens
    splits = [(ids[:k], ids[k:]) for k in range(1, len(ids))]  # every context/continuation split of the prompt
    scores = Scorer(server.params, CFG, progress=False).score(splits)
    for k, score in zip(range(1, len(ids)), scores, strict=True):
        assert sum(lp.token_logprobs[k:len(ids)]) == pytest.approx(score.logprob, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="echo"):
        server.client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_logit_bias_and_its_bad_values(server):
    z = TOKENIZER.encode("z")[0]
    got = server.client.completions.create(model="tiny", prompt="ab", max_tokens=6, temperature=0.7, seed=1,
                                           logit_bias={str(z): 100})
    assert got.choices[0].text == "zzzzzz"
    for bias in ({"x": 1}, {str(len(TOKENIZER.chars)): 1}, {"3": 101}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            server.client.completions.create(model="tiny", prompt="ab", max_tokens=2, logit_bias=bias)


def test_ignore_eos_decodes_past_end_of_text(server):
    """The end-of-text token is the greedy first token here: a request ends at it, unless it ignores eos. Either
    way the engine marks it an end token (no text)."""
    eot = TOKENIZER.encode(alone(server, "ab", 1, 0.0, 0))[0]
    engine = Engine(server.params, CFG, slots=server.engine.n_slots, eot_token=eot)  # the server's compiled programs
    tokens: dict[bool, list[tuple[int, bool]]] = {False: [], True: []}
    for ignore in (False, True):
        engine.submit(Request(TOKENIZER.encode("ab"), 5, temperature=0, ignore_eos=ignore,
                              emit=lambda token, _lp, _top, end, ignore=ignore: tokens[ignore].append((token, end)),
                              done=lambda _: None))
    engine.drain()
    assert tokens[False] == [(eot, True)] and len(tokens[True]) == 5 and tokens[True][0] == (eot, True)
    assert all(end == (token == eot) for token, end in tokens[True])


def test_chat_completions_render_the_template(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = "system: be brief\nuser: hi\nassistant:"
    got = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.8,
                                                seed=5, n=2, logprobs=True, top_logprobs=3)
    assert [c.message.content for c in got.choices] == [alone(server, text, 10, 0.8, 5),
                                                        alone(server, text, 10, 0.8, 6)]
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(text) * 2 and got.usage.completion_tokens == 20
    content = got.choices[0].logprobs.content
    assert "".join(t.token for t in content) == got.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    full = alone(server, text, 20, 0.0, 0)
    cut = server.client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20,
                                                temperature=0, stop=full[8:10])
    assert cut.choices[0].message.content == full[:full.find(full[8:10])] and cut.choices[0].finish_reason == "stop"
    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=3,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == alone(server, text, 12, 1.0, 3)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert server.client.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0
                                                 ).choices[0].message.content == alone(server, "user: hi\nassistant:",
                                                                                                 4, 0.0, 0)


def test_chat_without_a_template_says_how_to_give_one(tmp_path):
    plain = Server(slots=1)
    try:
        with pytest.raises(openai.BadRequestError, match="--chat_template FILE"):
            plain.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        plain.close()
    with pytest.raises(UserError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    assert load_template(tmp_path, None) is None
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert load_template(tmp_path, None) == TEMPLATE
    with pytest.raises(UserError, match="no such file"):
        load_template(tmp_path, tmp_path / "absent.jinja")


def test_tokenizer_endpoints_as_vllm_answers_them(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(root(server, "/tokenizer_info"), headers=headers).json()
    assert info["eos_token"] is None and info["model_max_length"] == CFG.block_size
    assert info["chat_template"] == TEMPLATE
    ids = httpx.post(root(server, "/tokenize"), json={"prompt": "abc", "add_special_tokens": False},
                     headers=headers).json()["tokens"]
    assert ids == TOKENIZER.encode("abc")
    assert httpx.post(root(server, "/detokenize"), json={"tokens": ids}, headers=headers).json() == {"prompt": "abc"}
    bad = httpx.post(root(server, "/detokenize"), json={"tokens": [-1]}, headers=headers)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_the_key_the_body_limit_and_undeclared_paths(server):
    assert httpx.get(root(server, "/health")).status_code == 200  # no key needed
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize"), ("GET", "/openapi.json")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = httpx.request(method, root(server, path), json={}, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="a", max_tokens=1)
    with pytest.raises(openai.APIStatusError) as err:
        server.client.completions.create(model="tiny", prompt="a" * LIMIT, max_tokens=1)
    assert err.value.status_code == 413 and err.value.body["message"]
    missing = httpx.get(root(server, "/v2/nothing"), headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_open_paths_answer_without_the_key_and_an_unknown_one_is_named():
    """`jaxgpt serve --open_paths`: the named paths answer without the key, every other still needs it; a path the
    server does not answer is a UserError naming it (the command's one-line error)."""
    import multiprocessing

    from jaxgpt.serve.app import Served, create_app
    from jaxgpt.serve.client import EngineClient

    tokenizer_paths = ("/tokenizer_info", "/tokenize", "/detokenize")
    opened = Server(api_key=KEY, open_paths=tokenizer_paths)
    try:
        assert httpx.get(root(opened, "/tokenizer_info")).status_code == 200
        assert httpx.post(root(opened, "/tokenize"), json={"prompt": "ab"}).json()["tokens"] == TOKENIZER.encode("ab")
        assert httpx.get(root(opened, "/v1/models")).status_code == 401
        assert httpx.post(root(opened, "/v1/completions"), json={"prompt": "a"}).status_code == 401
    finally:
        opened.close()
    with pytest.raises(UserError, match="/tokenizer-info is not a path this server answers"):
        create_app(EngineClient(multiprocessing.Pipe()[0], None),
                   Served(TOKENIZER, "tiny", CFG, 1, api_key=KEY, open_paths=("/tokenizer-info",)))


def test_openapi_declares_every_status_the_routes_answer(server):
    spec = httpx.get(root(server, "/openapi.json"), headers={"Authorization": f"Bearer {KEY}"}).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"200", "400", "401", "413", "429", "500"} <= set(spec["paths"][path]["post"]["responses"])
    assert {"200", "401", "413"} <= set(spec["paths"]["/metrics"]["get"]["responses"])


def test_metrics_parse_with_prometheus_clients_parser(server):
    server.client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    httpx.get(root(server, "/v1/models"))  # a 401
    text = httpx.get(root(server, "/metrics"), headers={"Authorization": f"Bearer {KEY}"}).text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    value = lambda name, suffix="", **labels: sum(
        s.value for s in families[name].samples
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))
    assert value("jaxgpt_requests", "_total", path="/v1/completions", status="200") >= 1
    assert value("jaxgpt_requests", "_total", path="/v1/models", status="401") >= 1
    assert value("jaxgpt_prompt_tokens", "_total") >= 3 and value("jaxgpt_generated_tokens", "_total") >= 4
    assert value("jaxgpt_time_to_first_token_seconds", "_count") >= 1
    assert value("jaxgpt_inter_token_latency_seconds", "_count") >= 3
    assert value("jaxgpt_slots") == 4 and value("jaxgpt_busy_slots") == 0 and value("jaxgpt_queue_depth") == 0


@pytest.mark.torch
def test_lm_eval_sees_the_tokenizer_endpoints(server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server.url + "/completions", auth_token=KEY)
    remote = utils.RemoteTokenizer(server.url + "/completions", auth_token=KEY)
    assert remote.encode("abc") == TOKENIZER.encode("abc") and remote.decode([0, 1, 2]) == TOKENIZER.decode([0, 1, 2])
