"""Make the numpy reference and test helpers importable, keep test runs on the CPU, and share a small corpus."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The tests' programs are tiny, so XLA:CPU spends most of a test in LLVM's optimisation passes, not in
    # running it: at level 0 they compile about 3.5x faster (CPU time of test_model.py's init, remat and dropout
    # tests: 270 s -> 78 s). Every comparison with a reference has a tolerance that holds at either level, and
    # subprocesses inherit the flag. Benchmarks and accelerator runs keep XLA's default.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared character-level dataset of real Python source (read-only: shared by every test)."""
    from tests_helpers import prepare_test_corpus

    return prepare_test_corpus(tmp_path_factory.mktemp("data"))
