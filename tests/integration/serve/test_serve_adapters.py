"""`jaxgpt serve --adapter NAME=PATH`, over real HTTP through the openai client: five adapters of different ranks
(four LoRA runs, one of them on the token table, and a PEFT directory) and the base answer concurrent greedy
requests, each with its merged model's tokens; /v1/models lists them; an unknown model is OpenAI's 404; bad
--adapter values are one line, exit 2, nothing served."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("safetensors")

from helpers import one_line_error, serving  # noqa: E402
from helpers.adapters import random_adapters, save_lora_run  # noqa: E402
from helpers.models import random_params, save_run  # noqa: E402
from helpers.server import CFG, TOKENIZER  # noqa: E402

from jaxgpt.commands import serve  # noqa: E402
from jaxgpt.generate import sampling  # noqa: E402
from jaxgpt.io import weights  # noqa: E402
from jaxgpt.io.peft import read_adapter, write_peft  # noqa: E402
from jaxgpt.model import lora  # noqa: E402
from jaxgpt.model.gpt import abstract_variables  # noqa: E402

ENV = {"JAX_PLATFORMS": "cpu"}
PROMPTS = ["def f(", "x = (a, b)", "import os", "q"]
# targets, rank, alpha; "table" adapts the (tied) token table: its lookup and the head that reads it
RUNS = {"narrow": ("q,v", 2, 4.0), "wide": ("", 4, 8.0), "deep": ("o,down", 8, 8.0), "table": ("embed,v", 2, 4.0)}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base run, three LoRA runs of it, a PEFT adapter of it (rank 3), and a LoRA run of another base."""
    root = tmp_path_factory.mktemp("adapters")
    base = save_run(root / "base", CFG, random_params(CFG), TOKENIZER.to_meta())
    paths = {"base": base}
    for seed, (name, (targets, rank, alpha)) in enumerate(RUNS.items(), 1):
        paths[name] = save_lora_run(root / name, f"workdir:{base}", CFG, random_adapters(CFG, targets, rank, seed),
                                    TOKENIZER.to_meta(), rank, alpha)
    paths["peft"] = write_peft(random_adapters(CFG, "o,up,down", 3, seed=9), CFG,
                               {"rank": 3, "alpha": 6.0, "rslora": False}, root / "peft", "base")
    paths["other"] = save_lora_run(root / "other", f"workdir:{base}", CFG, random_adapters(CFG, "q", 2, 5),
                                   TOKENIZER.to_meta(), 2, 4.0, base_sha="0123456789abcdef")
    saving = {**random_adapters(CFG, "q", 2, 6), lora.SAVED: {"ln_f": {"scale": np.full(CFG.n_embd, 2, np.float32)}}}
    paths["saving"] = save_lora_run(root / "saving", f"workdir:{base}", CFG, saving, TOKENIZER.to_meta(), 2, 4.0)
    return paths


def adapter_flags(made: dict[str, Path]) -> list[str]:
    return [*(f"--adapter={name}={made[name]}" for name in RUNS), f"--adapter=tuned=peft:{made['peft']}"]


def merged(made: dict[str, Path]) -> dict[str, dict]:
    """Each served name's weights merged: the base, each LoRA run as `io.weights` loads it, the PEFT adapter on it."""
    base = weights.load(f"workdir:{made['base']}")
    peft, s = read_adapter(str(made["peft"]), CFG, abstract_variables(CFG)["params"])
    return {"base": base.params, **{name: weights.load(f"workdir:{made[name]}").params for name in RUNS},
            "tuned": lora.merge(base.params, peft, s)}


def test_adapters_and_the_base_answer_concurrent_requests_with_their_merged_models(made, tmp_path):
    """24 greedy requests at once, 4 per model over 8 slots: each answer is its merged model's tokens alone, and
    every adapter says something else than the base for some prompt. /v1/models lists the base and the adapters,
    each adapter's entry naming the base as its parent and its directory as its root."""
    models = merged(made)
    with serving(f"--workdir={made['base']}", *adapter_flags(made), "--slots=8", log=tmp_path / "log",
                 env=ENV) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        listed = client.models.list().data
        assert [m.id for m in listed] == ["base", "narrow", "wide", "deep", "table", "tuned"]
        assert [m.model_extra["parent"] for m in listed] == [None] + ["base"] * 5
        assert [m.model_extra["root"] for m in listed[1::4]] == [str(made["narrow"]), str(made["peft"])]
        work = [(name, prompt) for name in models for prompt in PROMPTS]
        ask = lambda w: client.completions.create(model=w[0], prompt=w[1], max_tokens=10, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            answers = list(pool.map(ask, work))
    said: dict[str, list[str]] = {}
    for (name, prompt), answer in zip(work, answers, strict=True):
        want = sampling.generate(models[name], CFG, TOKENIZER.encode(prompt), max_new_tokens=10, temperature=0.0)[0]
        assert answer.model == name
        assert answer.choices[0].text == TOKENIZER.decode(want.tolist()), (name, prompt)
        said.setdefault(name, []).append(answer.choices[0].text)
    assert all(said[name] != said["base"] for name in models if name != "base")


def test_an_unknown_model_is_openais_404_and_the_base_answers_to_its_name_or_none(made, tmp_path):
    with serving(f"--workdir={made['base']}", f"--adapter=narrow={made['narrow']}", log=tmp_path / "log",
                 env=ENV) as (_, url):
        answer = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "a", "max_tokens": 2})
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
        assert "nope" in error["message"] and "narrow" in error["message"]
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": [
            {"role": "user", "content": "a"}]})
        assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="a", max_tokens=2)
        named = client.completions.create(model="base", prompt="ab", max_tokens=4, temperature=0)
        unnamed = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4, "temperature": 0}).json()
        assert named.choices[0].text == unnamed["choices"][0]["text"] and unnamed["model"] == "base"


@pytest.mark.parametrize("given, says", [
    (["sql"], "is not NAME=PATH"),
    (["=runs/x"], "is not NAME=PATH"),
    (["a={narrow}", "a={wide}"], "two adapters are named 'a'"),
    (["base={narrow}"], "is the base model's name"),
    (["a={missing}"], "no such directory"),
    (["a={other}"], "not the weights served here"),
    (["a={base}"], "not LoRA adapters"),
    (["a={saving}"], "in full beside its adapters"),  # modules_to_save: per-adapter full tensors, serve it merged
])
def test_bad_adapters_are_one_line_and_nothing_is_served(made, capsys, given: list[str], says: str):
    paths = {**{k: str(v) for k, v in made.items()}, "missing": str(made["base"].parent / "missing")}
    status = serve.main(["jaxgpt serve", f"--workdir={made['base']}", "--port=1",
                         *(f"--adapter={g.format(**paths)}" for g in given)])
    out, err = capsys.readouterr()
    assert says in one_line_error((status, err)) and "serving" not in out
