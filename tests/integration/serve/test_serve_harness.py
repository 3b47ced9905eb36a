"""lm-evaluation-harness's `local-completions` (how the harness evaluates any served model) against `jaxgpt serve`
on 127.0.0.1: it finds the server's tokenizer endpoints, sends token-id prompts with echo and logprobs, and gets
the log-likelihoods `jaxgpt harness` computes in process, and the same generate_until text; its command runs
against a server with an API key whose tokenizer paths are left open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")

from helpers.evals import CFG, TOL, responses
from helpers.server import KEY, Server

from jaxgpt.io import weights

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def served(exported: Path) -> Server:
    loaded = weights.load(f"hf:{exported}")
    s = Server(model=(loaded.params, CFG, loaded.tokenizer(None), None))
    yield s
    s.close()


def evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import jaxgpt.evals.harness  # noqa: F401  (registers "jaxgpt")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc"], batch_size=4,
                                   task_manager=TaskManager(include_path=str(task_dir)), device="cpu",
                                   log_samples=True)


def local_completions(served: Server) -> dict[str, str]:
    """The model_args of local-completions for the server (the harness keeps a prompt to max_length - 1 tokens,
    leaving one for the token it asks for)."""
    return {"base_url": f"{served.url}/completions", "model": "tiny", "tokenizer_backend": "remote",
            "max_length": str(CFG.block_size), "num_concurrent": "1", "max_retries": "1"}


@pytest.mark.slow  # about 85 s on a loaded 2-core CPU: the harness runs the task twice
def test_local_completions_scores_as_jaxgpt_harness(served: Server, exported: Path, task_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    theirs = evaluate("local-completions", ",".join(f"{k}={v}" for k, v in local_completions(served).items()),
                      task_dir)
    ours = evaluate("jaxgpt", f"init_from=hf:{exported}", task_dir)
    flat = lambda result: np.ravel(np.array(responses(result, "tiny_mc"), dtype=object).tolist()).astype(float)
    assert flat(ours).size == 2 * 48  # a log-likelihood and a greedy flag for every choice
    np.testing.assert_allclose(flat(theirs), flat(ours), rtol=0, atol=TOL)
    assert theirs["results"]["tiny_mc"]["acc,none"] == ours["results"]["tiny_mc"]["acc,none"]


def test_local_completions_generates_as_jaxgpt_harness(served: Server, exported: Path) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from jaxgpt.evals.harness import JaxGPTLM

    prompts = ["the cat sat on the", "a red house", "river"]
    requests = [Instance("generate_until", {}, (p, {"until": ["garden"], "max_gen_toks": 12, "do_sample": False}), 0)
                for p in prompts]
    args = {**local_completions(served), "max_length": CFG.block_size, "num_concurrent": 1, "max_retries": 1}
    remote = LocalCompletionsAPI(**args)
    assert remote.generate_until(requests, disable_tqdm=True) == JaxGPTLM(init_from=f"hf:{exported}").generate_until(
        requests, disable_tqdm=True)


@pytest.mark.slow  # about 35 s on a loaded 2-core CPU, most of it the harness's start
def test_lm_eval_command_against_a_keyed_server_with_open_tokenizer_paths(exported: Path, task_dir: Path,
                                                                          tmp_path: Path) -> None:
    """The harness's remote tokenizer sends no key (unless model_args has auth_token): `--open_paths` leaves the
    tokenizer's paths open while completions still need the key, which the harness sends from OPENAI_API_KEY."""
    import httpx

    loaded = weights.load(f"hf:{exported}")
    keyed = Server(model=(loaded.params, CFG, loaded.tokenizer(None), None), api_key=KEY,
                   open_paths=("/tokenizer_info", "/tokenize", "/detokenize"))
    try:
        assert httpx.get(f"http://127.0.0.1:{keyed.port}/tokenizer_info").status_code == 200
        assert httpx.post(f"{keyed.url}/completions", json={"prompt": "a"}).status_code == 401
        model_args = ",".join(f"{k}={v}" for k, v in local_completions(keyed).items())
        command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                   model_args, "--tasks", "tiny_mc", "--include_path", str(task_dir), "--limit", "4",
                   "--output_path", str(tmp_path)]
        done = subprocess.run(command, env={**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]["tiny_mc"]
        assert 0 <= results["acc,none"] <= 1
    finally:
        keyed.close()
