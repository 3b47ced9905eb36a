"""Make the numpy reference importable and keep test runs on the CPU with a warm compile cache."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
