"""`jaxgpt serve --follow` on a run whose checkpoints keep coming: each new one is served once the requests in
flight have finished with the previous one; unusable ones are one line each, and the previous weights stay."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

pytest.importorskip("httpx")  # serving waits for /health with it
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import serving  # noqa: E402
from helpers.models import random_params, save_run  # noqa: E402
from helpers.server import CFG, TOKENIZER  # noqa: E402

from jaxgpt.generate import sampling  # noqa: E402
from jaxgpt.generate.engine import Engine, Request  # noqa: E402
from jaxgpt.io.checkpoint import Checkpointer  # noqa: E402
from jaxgpt.model.config import ModelConfig  # noqa: E402

PROMPT, LONG = "abc", 50


def save_step(workdir: Path, step: int, cfg: ModelConfig, params: dict) -> None:
    """A checkpoint of `step`, as the trainer writes it (what a run still training commits next)."""
    ckpt = Checkpointer(workdir)
    ckpt.save({"params": params, "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": step},
              {"model": cfg.to_dict(), "tokenizer": TOKENIZER.to_meta(), "val_loss": 1.0})
    ckpt.wait()
    ckpt.close()


def greedy(params: dict, max_tokens: int) -> str:
    tokens = sampling.generate(params, CFG, TOKENIZER.encode(PROMPT), max_new_tokens=max_tokens, key=0,
                               temperature=0.0)[0]
    return TOKENIZER.decode(tokens.tolist())


def wait_for(condition, what: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, f"{what}: not within {timeout} s\n{log.read_text()}"
        time.sleep(0.05)


def test_a_swap_waits_for_the_requests_in_flight():
    """Weights swapped while a request decodes: it ends on the old ones; one submitted then starts on the new."""
    old, new = random_params(CFG, seed=1), random_params(CFG, seed=2)
    engine = Engine(old, CFG, slots=2, version="old")
    tokens: dict[str, list[int]] = {"first": [], "second": []}
    second = Request(TOKENIZER.encode(PROMPT), LONG, temperature=0.0, emit=lambda t, *_: tokens["second"].append(t),
                     done=lambda _: None)

    def first_emit(token: int, *_: object) -> None:
        tokens["first"].append(token)
        if len(tokens["first"]) == 3:  # mid-request, from the engine's thread between two steps
            engine.swap(new, "new")
            engine.submit(second)

    first = Request(TOKENIZER.encode(PROMPT), LONG, temperature=0.0, emit=first_emit, done=lambda _: None)
    engine.submit(first)
    engine.drain()
    assert (first.version, TOKENIZER.decode(tokens["first"])) == ("old", greedy(old, LONG))
    assert (second.version, TOKENIZER.decode(tokens["second"])) == ("new", greedy(new, LONG))
    assert engine.version == "new"


def test_follow_swaps_in_new_checkpoints_between_requests(tmp_path):
    params = {step: random_params(CFG, seed=step) for step in (1, 2)}
    run = save_run(tmp_path / "run", CFG, params[1], TOKENIZER.to_meta())
    expected = {f"step-{s}": greedy(p, LONG) for s, p in params.items()}
    assert expected["step-1"] != expected["step-2"]
    log = tmp_path / "stderr.txt"
    with serving(f"--workdir={run}", "--follow", "--follow_interval=0.1", "--slots=2", log=log,
                 env={"JAX_PLATFORMS": "cpu"}) as (proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        served = lambda: client.models.list().data[0].system_fingerprint
        assert served() == "step-1"
        answers, failures, stop = [], [], threading.Event()

        def keep_asking() -> None:  # requests in flight across the swap: none may fail or mix weights
            while not stop.is_set():
                try:
                    answers.append(client.completions.create(model="run", prompt=PROMPT, max_tokens=LONG,
                                                             temperature=0))
                except Exception as e:  # reported by the assertion below
                    failures.append(e)

        clients = [threading.Thread(target=keep_asking) for _ in range(2)]
        for t in clients:
            t.start()
        wait_for(lambda: len(answers) >= 2, "answers from step 1", proc, log)
        save_step(run, 2, CFG, params[2])
        wait_for(lambda: served() == "step-2", "step 2 served", proc, log)
        wait_for(lambda: sum(a.system_fingerprint == "step-2" for a in answers) >= 2, "answers from step 2",
                 proc, log)
        stop.set()
        for t in clients:
            t.join()
        assert not failures
        assert {a.system_fingerprint for a in answers} == {"step-1", "step-2"}
        for a in answers:  # each answer wholly from the weights it names
            assert a.choices[0].text == expected[a.system_fingerprint] and a.choices[0].finish_reason == "length"

        # A checkpoint of another model, then a corrupt one (moved in whole, as a commit does): one line each.
        save_step(run, 3, CFG.replace(n_embd=16), random_params(CFG.replace(n_embd=16)))
        wait_for(lambda: "step 3 not served" in log.read_text(), "the refusal of step 3", proc, log)
        other = tmp_path / "other"
        save_step(other, 4, CFG, params[1])
        for f in (other / "checkpoints" / "4" / "params").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"")
        (other / "checkpoints" / "4").rename(run / "checkpoints" / "4")
        wait_for(lambda: "step 4" in log.read_text(), "the failure of step 4", proc, log)
        time.sleep(0.5)  # several more polls: neither step is retried nor reported again
        answer = client.completions.create(model="run", prompt=PROMPT, max_tokens=LONG, temperature=0)
        assert (answer.system_fingerprint, answer.choices[0].text) == ("step-2", expected["step-2"])
        assert served() == "step-2"
        lines = [line for line in log.read_text().splitlines() if line.startswith("follow ")]
        assert len(lines) == 3, lines
        assert "serving step-2 (was step-1)" in lines[0] and "step 3 not served" in lines[1]
        assert "CheckpointReadError" in lines[2] and "still serving step-2" in lines[2]
    assert "Traceback" not in log.read_text()


def test_follow_needs_a_workdir(capsys):
    from jaxgpt.commands import serve

    assert serve.main(["jaxgpt serve", "--preset=gpt2", "--follow"]) != 0
    assert "--follow follows a training run's checkpoints" in capsys.readouterr().err
