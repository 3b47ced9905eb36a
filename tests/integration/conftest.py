"""Fixtures the integration tests share: a tiny GPT-2 exported to a Hugging Face directory and a harness task
directory (tests/helpers/evals.py), which the evaluation and the served-harness tests both score."""

from helpers.evals import exported, task_dir  # noqa: F401 (fixtures, found here by pytest)
