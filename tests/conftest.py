"""Make the numpy reference and test helpers importable, keep test runs on the CPU, and share a small corpus."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared character-level dataset of real Python source (read-only: shared by every test)."""
    from tests_helpers import prepare_test_corpus

    return prepare_test_corpus(tmp_path_factory.mktemp("data"))
