"""Talking to a chat run: the page `jaxgpt serve` answers GET / with, driven in a real browser (headless Chromium
through Playwright), `jaxgpt sample --chat` on a terminal and on a file of conversations, and chat data from a
Hugging Face Hub dataset.

The browser test skips where Chromium or Playwright is missing (.ci/run's oldest lane installs both). With
JAXGPT_CHAT_SCREENSHOT=PATH it saves a screenshot of the page after the chat; JAXGPT_CHAT_RUN=DIR serves that
run instead of the tiny one made here (the README's docs/chat_page.png: a copy of runs/chat_sft).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import offline_train_error, one_line_error, serving, train_run
from helpers.chat import ALPHABET, render, sft_config
from helpers.models import random_params, save_random_lm, save_run

from jaxgpt.data.conversations import ChatTemplate, hub_conversations, load_hub
from jaxgpt.data.tokenizer import CharTokenizer
from jaxgpt.errors import UserError
from jaxgpt.generate import sampling
from jaxgpt.generate.chat import ChatModel
from jaxgpt.io import weights
from jaxgpt.model.config import ModelConfig

pytestmark = pytest.mark.browser

BLOCK = 160  # context of the tiny chat run: room for a few turns of its nonsense replies
KEY = "page-key"
ANSWER_TOKENS = 16  # the page's max tokens
QUESTIONS = ("Spell 'gpt' backwards.", "What is 7 + 5?", "How many times does the letter 'a' appear in 'banana'?")
CHROMIUM = os.environ.get("JAXGPT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of task chat as train.py leaves one (template file, meta["chat"]), fine-tuned for two steps from a
    random character model whose greedy choices are far from ties: its replies are nonsense, which is all these
    checks need."""
    base, workdir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("chat")
    cfg = ModelConfig(vocab_size=len(ALPHABET), block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)
    save_run(base, cfg, random_params(cfg), CharTokenizer(ALPHABET).to_meta())
    train_run(sft_config(workdir, base, max_steps=2, eval_interval=2, log_interval=2))
    return workdir


def greedy_reply(loaded: weights.Weights, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """The greedy reply as `generate` writes it for the rendered conversation, cut at the chat end token."""
    tok, end_id = loaded.tokenizer(), loaded.meta["chat"]["end_id"]
    ids = tok.encode(render(messages, add_generation_prompt=True))
    new = sampling.generate(loaded.params, loaded.model, ids, max_new_tokens=min(max_new_tokens, BLOCK - len(ids)),
                            temperature=0.0)[0].tolist()
    return tok.decode(new[:new.index(end_id)] if end_id in new else new)


def sample_main(argv: list[str], stdin: str, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    from jaxgpt.commands import sample

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = sample.main(["jaxgpt sample", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------------
# The terminal: sample --chat


def test_terminal_chat_keeps_the_history_and_answers_greedily(chat_run: Path, monkeypatch, capsys) -> None:
    pytest.importorskip("jinja2")
    lines = [QUESTIONS[0], QUESTIONS[1], "a line with <|end|> in it", "/new", "/system Ada's pet is a cat.",
             "What is Ada's pet?"]
    code, out, err = sample_main([f"--workdir={chat_run}", "--chat", "--temperature=0", "--max_new_tokens=12"],
                                 "\n".join(lines) + "\n", monkeypatch, capsys)
    assert code == 0, err
    loaded = weights.load(f"workdir:{chat_run}")
    first = [{"role": "user", "content": QUESTIONS[0]}]
    first.append({"role": "assistant", "content": greedy_reply(loaded, first, 12)})
    second = [*first, {"role": "user", "content": QUESTIONS[1]}]  # the second turn sees the first
    fact = [{"role": "system", "content": "Ada's pet is a cat."}, {"role": "user", "content": "What is Ada's pet?"}]
    expected = [first[1]["content"], greedy_reply(loaded, second, 12), greedy_reply(loaded, fact, 12)]
    assert out.split("\n")[:-1] == expected
    assert err.count("error: ") == 1 and "special token" in err  # the bad turn is left out; the session goes on


def test_a_reply_ends_at_the_end_token_streamed_or_batched(chat_run: Path) -> None:
    """The end token is set to the fourth token the model writes: both ways stop after three, and say no more."""
    pytest.importorskip("jinja2")
    loaded = weights.load(f"workdir:{chat_run}")
    tok, messages = loaded.tokenizer(), [{"role": "user", "content": QUESTIONS[1]}]
    ids = tok.encode(render(messages, add_generation_prompt=True))
    new = sampling.generate(loaded.params, loaded.model, ids, max_new_tokens=8, temperature=0.0)[0].tolist()
    end = next(i for i, t in enumerate(new) if t not in new[:i] and i >= 3)
    model = ChatModel(loaded.params, loaded.model, tok, ChatTemplate(loaded.meta["chat"]["template"]), new[end])
    streamed = list(model.stream(messages, max_new_tokens=20, temperature=0.0, chunk_size=2))
    assert "".join(streamed) == tok.decode(new[:end]) and len([s for s in streamed if s]) > 1
    assert model.replies([("q", messages)], max_new_tokens=20, seed=0, temperature=0.0, top_p=1.0,
                         slots=2) == [tok.decode(new[:end])]


def test_prompt_file_of_conversations_prints_each_with_its_reply(chat_run: Path, tmp_path: Path, monkeypatch,
                                                                 capsys) -> None:
    pytest.importorskip("jinja2")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    conversations[2] = [{"role": "system", "content": "Be brief."}, *conversations[2]]
    path = tmp_path / "ask.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    argv = [f"--workdir={chat_run}", "--chat", f"--prompt_file={path}", "--temperature=0", "--max_new_tokens=10",
            "--batch_size=2"]
    code, out, err = sample_main(argv, "", monkeypatch, capsys)
    assert code == 0, err
    loaded = weights.load(f"workdir:{chat_run}")
    assert [json.loads(line)["messages"] for line in out.splitlines()] == [
        [*c, {"role": "assistant", "content": greedy_reply(loaded, c, 10)}] for c in conversations]
    path.write_text(json.dumps({"messages": [*conversations[0], {"role": "assistant", "content": "x"}]}) + "\n")
    code, _, err = sample_main(argv, "", monkeypatch, capsys)
    assert "ask.jsonl:1: the last turn is not the user's" in one_line_error((code, err))


def test_chat_with_a_run_that_has_no_chat_template_says_how_to_make_one(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    save_random_lm(tmp_path, ModelConfig(vocab_size=len(ALPHABET), block_size=16, n_layer=1, n_head=1, n_embd=8),
                   CharTokenizer(ALPHABET))
    code, _, err = sample_main([f"--workdir={tmp_path}", "--chat"], "hi\n", monkeypatch, capsys)
    assert "no chat template" in one_line_error((code, err)) and "configs/chat_sft.py" in err


# ----------------------------------------------------------------------------------------------------
# Chat data from the Hugging Face Hub


def test_hub_rows_become_conversations_and_a_bad_row_is_named() -> None:
    datasets = pytest.importorskip("datasets")
    turn = lambda role, text: {"role": role, "content": text}
    rows = datasets.Dataset.from_list([
        {"messages": [turn("user", "hi"), turn("assistant", "hello")], "source": "a"},
        {"messages": [turn("system", "be brief"), turn("user", "2 + 2?"), turn("assistant", "4")], "source": "b"}])
    assert hub_conversations(rows, "hf:x") == [(0, rows[0]["messages"]), (1, rows[1]["messages"])]
    bad = datasets.Dataset.from_list([rows[0], {"messages": [turn("user", "hi")], "source": "c"}])
    with pytest.raises(UserError, match=r"^hf:x row 1: no assistant turn$"):
        hub_conversations(bad, "hf:x")


def test_without_datasets_the_hub_error_names_the_local_file_route(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it fails
    with pytest.raises(UserError, match=r"needs the `datasets` library .*--config\.chat\.data=chat\.jsonl"):
        load_hub("hf:HuggingFaceTB/smoltalk:all", "config.chat.data")


def test_offline_hub_dataset_is_one_line_naming_the_local_file_route(chat_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    line = offline_train_error(tmp_path, "--config=configs/chat_sft.py", f"--config.workdir={tmp_path / 'w'}",
                               f"--config.init_from=workdir:{chat_run}",
                               "--config.chat.data=hf:HuggingFaceTB/smoltalk:all")
    assert "cannot be reached" in line and "load_dataset('HuggingFaceTB/smoltalk', 'all', split='train')" in line
    assert line.endswith("--config.chat.data=chat.jsonl")


# ----------------------------------------------------------------------------------------------------
# The page, in a browser


@pytest.fixture(scope="module")
def served(chat_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(URL, run) of `jaxgpt serve --api_key` on 127.0.0.1 serving the tiny chat run, or JAXGPT_CHAT_RUN."""
    for module in ("httpx", "uvicorn", "fastapi", "jinja2"):
        pytest.importorskip(module)
    run = Path(os.environ.get("JAXGPT_CHAT_RUN") or chat_run)
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with serving(f"--workdir={run}", f"--api_key={KEY}", "--slots=2", log=log, timeout=180) as (_, url):
        yield url, run


def test_the_page_is_one_file_served_without_the_key_which_the_api_needs(served: tuple[str, Path]) -> None:
    import httpx

    url, _ = served
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "<script src" not in page.text and "<link" not in page.text
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def send(page: Any, text: str, turn: int) -> str:
    """Type a message, press Enter, and wait until the `turn`-th answer has streamed in; its text."""
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function(f"document.body.dataset.state === 'idle' && "
                           f"document.querySelectorAll('.assistant').length === {turn}", timeout=120_000)
    return page.locator(".assistant .content").nth(turn - 1).inner_text()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium; or JAXGPT_CHROMIUM=PATH)")
def test_browser_chat_streams_the_greedy_answers_the_api_gives(served: tuple[str, Path]) -> None:
    """Three turns at temperature 0 in headless Chromium: each answer arrives in pieces and equals the API's greedy
    answer to the same conversation; "New chat" forgets it; without the key, the page says where to give it."""
    import httpx

    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 880, "height": 620})
            page.goto(url)
            page.fill("#api-key", KEY)
            page.press("#api-key", "Tab")  # a change event: the page stores the key
            page.fill("#temperature", "0")
            page.fill("#max-tokens", str(ANSWER_TOKENS))  # the tiny run's replies never end by themselves
            page.evaluate("window.updates = 0; new MutationObserver((records) => { window.updates += "
                          "records.length; }).observe(document.getElementById('log'), {childList: true, "
                          "subtree: true, characterData: true})")
            history: list[dict[str, str]] = []
            for turn, question in enumerate(QUESTIONS, 1):
                history.append({"role": "user", "content": question})
                shown = send(page, question, turn)
                api = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                                 json={"messages": history, "temperature": 0, "max_tokens": ANSWER_TOKENS})
                assert api.status_code == 200, (turn, api.text, shown)
                assert shown == api.json()["choices"][0]["message"]["content"], turn
                history.append({"role": "assistant", "content": shown})
            assert page.evaluate("window.updates") > 2 * len(QUESTIONS) + 1  # answers grew piece by piece
            if os.environ.get("JAXGPT_CHAT_SCREENSHOT"):
                page.screenshot(path=os.environ["JAXGPT_CHAT_SCREENSHOT"])
            page.click("#new-chat")
            assert page.locator(".message").count() == 0
            keyless = browser.new_page()  # a new context: no key stored
            keyless.goto(url)
            send(keyless, "hi", 1)
            assert "API key" in keyless.locator(".error").inner_text()
        finally:
            browser.close()
