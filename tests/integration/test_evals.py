"""Benchmarks the field uses: lm-evaluation-harness with jaxgpt beside transformers, and HellaSwag.

A small random GPT-2-shaped model (GPT-2's BPE, 2 layers, 32 wide) is exported to a local Hugging Face
directory; the harness then evaluates it once as `jaxgpt` and once as `hf` on task files this test writes
in the harness's own YAML/JSONL format, so nothing is downloaded. Both must score every request alike.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
if not os.environ.get("JAXGPT_BPE_FILE"):
    pytest.skip("needs the GPT-2 ranks offline (JAXGPT_BPE_FILE, see .ci/provision_bpe.sh)", allow_module_level=True)

from helpers.evals import TOL, responses, sentence
from reference import numpy_reference as ref

from jaxgpt.evals import benchmarks

pytestmark = pytest.mark.torch


def run_harness(model: str, model_args: str, task_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import jaxgpt.evals.harness  # noqa: F401  (registers "jaxgpt")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_rolling"],
                                   task_manager=TaskManager(include_path=str(task_dir)), batch_size=4,
                                   device="cpu", log_samples=True)


def test_harness_scores_equal_transformers(exported: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = run_harness("jaxgpt", f"init_from=hf:{exported}", task_dir)
    theirs = run_harness("hf", f"pretrained={exported},dtype=float32", task_dir)
    for task in ("tiny_mc", "tiny_rolling"):
        mine, ref_ = np.array(responses(ours, task), dtype=object), np.array(responses(theirs, task), dtype=object)
        flat = lambda r: np.ravel(r.tolist()).astype(float)  # log-likelihoods, and greedy flags as 0/1
        assert flat(mine).size == {"tiny_mc": 2 * 48, "tiny_rolling": 5}[task]  # every choice / document
        np.testing.assert_allclose(flat(mine), flat(ref_), rtol=0, atol=TOL)
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert math.isclose(ours["results"][task][metric], value, rel_tol=1e-5, abs_tol=TOL), (task, metric)


def test_generate_until_equals_transformers_greedy(exported: Path) -> None:
    import torch
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from jaxgpt.evals.harness import JaxGPTLM

    lm = JaxGPTLM(init_from=f"hf:{exported}")
    model, tok = GPT2LMHeadModel.from_pretrained(exported).eval(), AutoTokenizer.from_pretrained(exported)
    prompts = ["the cat sat on the", "a red house", "river"]
    requests = [Instance("generate_until", {}, (p, {"until": ["garden"], "max_gen_toks": 12, "do_sample": False}), 0)
                for p in prompts]
    got = lm.generate_until(requests, disable_tqdm=True)
    for prompt, text in zip(prompts, got, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
        expected = tok.decode(out[0, ids.shape[1]:]).split("garden")[0].split("<|endoftext|>")[0]
        assert text == expected


def test_hellaswag_accuracy_matches_float64_numpy(exported: Path, tmp_path: Path) -> None:
    from jaxgpt.io import weights

    rng = np.random.default_rng(5)
    examples = [{"ctx": sentence(rng, 5), "endings": [sentence(rng, int(rng.integers(1, 6))) for _ in range(4)],
                 "label": int(rng.integers(0, 4))} for _ in range(10)]
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    loaded = weights.load(f"hf:{exported}")
    tokenizer = loaded.tokenizer()
    result = benchmarks.evaluate("hellaswag", loaded.params, loaded.model, tokenizer, path, batch_size=4,
                                 progress=False)
    hits = hits_norm = 0
    for ex in examples:
        ctx = tokenizer.encode(ex["ctx"])
        sums, means = [], []
        for ending in ex["endings"]:
            end = tokenizer.encode(" " + ending)
            logp = ref.log_probs(loaded.params, np.array([ctx + end[:-1]]), loaded.model.to_dict())[0]
            picked = [logp[len(ctx) - 1 + j, t] for j, t in enumerate(end)]
            sums.append(sum(picked))
            means.append(sum(picked) / len(end))
        hits += int(np.argmax(sums) == ex["label"])
        hits_norm += int(np.argmax(means) == ex["label"])
    assert result.examples == len(examples)
    assert result.accuracy == hits / len(examples)
    assert result.accuracy_norm == hits_norm / len(examples)


def test_hellaswag_errors_are_one_line(tmp_path: Path) -> None:
    from jaxgpt.errors import UserError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 5}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:1"):
        benchmarks.read(bad)
    bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n[1, 2]\n')  # JSON, but not an object
    with pytest.raises(UserError, match=r"bad.jsonl:2: not a HellaSwag example"):
        benchmarks.read(bad)
    with pytest.raises(UserError, match=r"bad.jsonl:1: not valid JSON"):
        bad.write_text("{oops\n")
        benchmarks.read(bad)
    bad.unlink()
    bad.mkdir()  # unreadable: one line, where a directory used to raise IsADirectoryError
    with pytest.raises(UserError, match=r"cannot read .*bad.jsonl"):
        benchmarks.read(bad)


def test_lambada_matches_float64_numpy(exported: Path, tmp_path: Path) -> None:
    from jaxgpt.io import weights

    rng = np.random.default_rng(6)
    passages = [sentence(rng, int(rng.integers(3, 12))) for _ in range(8)]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
    loaded = weights.load(f"hf:{exported}")
    tokenizer = loaded.tokenizer()
    result = benchmarks.evaluate("lambada", loaded.params, loaded.model, tokenizer, path, batch_size=4,
                                 progress=False)
    total, hits = 0.0, 0
    for passage in passages:
        context, word = passage.rsplit(" ", 1)
        ctx, target = tokenizer.encode(context), tokenizer.encode(" " + word)
        logp = ref.log_probs(loaded.params, np.array([ctx + target[:-1]]), loaded.model.to_dict())[0]
        rows = logp[len(ctx) - 1:]
        total += sum(rows[j, t] for j, t in enumerate(target))
        hits += int(all(np.argmax(rows[j]) == t for j, t in enumerate(target)))
    assert result.accuracy == hits / len(passages)
    assert math.isclose(result.perplexity, math.exp(-total / len(passages)), rel_tol=1e-5)


def test_eval_and_harness_commands(exported: Path, task_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxgpt.commands import eval as eval_command
    from jaxgpt.commands import harness

    rng = np.random.default_rng(7)
    path = tmp_path / "hs.jsonl"
    path.write_text("".join(json.dumps({"ctx": sentence(rng, 4), "endings": ["cat", "dog sat"], "label": 1}) + "\n"
                            for _ in range(6)))
    argv = ["jaxgpt eval", f"--init_from=hf:{exported}", "--benchmark=hellaswag", f"--data={path}", "--limit=4"]
    assert eval_command.main(argv) == 0
    scored = capsys.readouterr().out
    assert scored.startswith("hellaswag: 4 examples, acc ")
    assert eval_command.main([argv[0], argv[1], "--task=hellaswag", *argv[3:]]) == 0  # the old name of the flag
    out, err = capsys.readouterr()
    assert out == scored and err.count("--task is deprecated") == 1
    assert err.startswith("warning: --task is deprecated: use --benchmark hellaswag\n")  # then the progress bar
    assert eval_command.main([*argv, "--task=lambada"]) == 2
    assert "--task=lambada and --benchmark=hellaswag disagree" in capsys.readouterr().err
    assert eval_command.main([*argv[:3], f"--data={tmp_path / 'missing.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.jsonl does not exist" in err

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert harness.main(["jaxgpt harness", "--model_args", f"init_from=hf:{exported}", "--tasks", "tiny_mc",
                         "--include_path", str(task_dir), "--limit", "4", "--device", "cpu"]) == 0
    assert "tiny_mc" in capsys.readouterr().out

