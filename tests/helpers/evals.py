"""A tiny GPT-2-shaped model exported for lm-evaluation-harness, and the harness task files it is scored on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.models import random_params
from jaxgpt.data import hf_tokenizer
from jaxgpt.data.tokenizer import load_bpe
from jaxgpt.io import hf
from jaxgpt.model.config import ModelConfig

CFG = ModelConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32)


TOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    params = random_params(CFG, seed=3, std=0.05)
    hf.save_hf(params, CFG, out)
    tokenizer = load_bpe()
    hf_tokenizer.save_hf_tokenizer(tokenizer, out, CFG.block_size)
    hf_tokenizer.save_generation_config(tokenizer, out)
    return out


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multiple-choice task and a rolling-perplexity task, as the harness reads them from disk."""
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    mc = [{"question": sentence(rng, 6) + " ", "choices": [sentence(rng, int(rng.integers(1, 5))) for _ in range(4)],
           "label": int(rng.integers(0, 4))} for _ in range(12)]
    rolling = [{"text": sentence(rng, int(rng.integers(20, 140)))} for _ in range(5)]  # some exceed one window
    for name, docs in (("mc", mc), ("rolling", rolling)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: train\n"
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files: {{train: {root / 'mc.jsonl'}}}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}dataset_kwargs:\n  data_files: {{train: {root / 'rolling.jsonl'}}}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return root


def responses(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "quickly", "slowly", "red", "blue",
         "house", "garden", "river"]


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))
