"""benchmarks/device_check.py itself, on this CPU: its --smoke run (every part at tiny shapes) and what that cannot
reach, so that the command an accelerator host gets minutes for cannot rot between such hosts. The whole smoke is
in the slow tier; CI runs a smoke of two parts, on both ends of the JAX range (GPU and TPU images ship the newest);
the PyTorch parts are smoked where torch is installed (the oldest lane).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT, device_check_smoke

pytestmark = pytest.mark.jax_release


@pytest.fixture(scope="module")
def device_check() -> Iterator[ModuleType]:
    """benchmarks/device_check.py as a module (its module level imports the standard library only)."""
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["device_check"]


def test_device_check_falls_back_past_out_of_memory_and_counts_unfinished_pytest_runs(device_check: ModuleType
                                                                                      ) -> None:
    """What --smoke cannot reach on a CPU: the next smaller batch after XLA's or PyTorch's out-of-memory error
    (any other error is the part's failure), and pytest's counts from its test lines when a timeout cut off its
    closing line."""
    def run(batch: int) -> str:
        if batch > 16:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes.")
        if batch == 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ran {batch}"

    batch, result, misses = device_check.largest_fitting(run, (64, 32, 16, 8, 4), cleanup=lambda: None)
    assert (batch, result, len(misses)) == (8, "ran 8", 3) and "RESOURCE_EXHAUSTED" in misses[0]
    with pytest.raises(ValueError):
        device_check.largest_fitting(lambda b: int("x"), (2, 1))
    with pytest.raises(RuntimeError, match="even batch 1"):
        device_check.largest_fitting(lambda b: run(64), (2, 1), cleanup=lambda: None)
    cut = "tests/test_a.py::test_x[1] PASSED  [ 10%]\ntests/test_a.py::test_y SKIPPED (no gpu) [ 20%]\n" \
          "tests/test_b.py::test_z FAILED  [ 30%]\ntests/test_b.py::test_w "
    assert device_check.pytest_counts(cut) == {"passed": 1, "skipped": 1, "failed": 1}
    workers = "[gw1] [ 10%] PASSED tests/test_a.py::test_x[1] \n[gw0] [ 20%] SKIPPED tests/test_a.py::test_y \n" \
              "[gw1] [ 30%] FAILED tests/test_b.py::test_z \n[gw0] [ 40%] PASSED tests/test_b.py::test_w \n"
    assert device_check.pytest_counts(workers) == {"passed": 2, "skipped": 1, "failed": 1}
    closing = cut + "\n===== 1 failed, 7 passed, 2 skipped, 1 error, 40 deselected in 12.50s (0:00:12) =====\n"
    assert device_check.pytest_counts(closing) == {"failed": 1, "passed": 7, "skipped": 2, "error": 1,
                                                   "deselected": 40}


def test_device_check_smoke_of_two_parts_writes_their_rows(tmp_path: Path, device_check: ModuleType) -> None:
    """The whole smoke's cheap sibling: `--smoke --parts env,train` runs those parts, each in its process, in that
    order, and writes their rows (passed, with their logs and the training part's measures) and no other."""
    proc, result = device_check_smoke(tmp_path / "check.json", "--parts", "env,train", timeout=300)
    assert result and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = result["parts"]
    assert list(parts) == ["env", "train"]
    for name, part in parts.items():
        assert part["status"] == "ok", (name, part.get("error"), part["log_tail"][-15:])
        assert Path(part["log"]).is_file()
    assert parts["train"]["metrics"]["tokens_per_s"] > 0 and parts["train"]["metrics"]["optimizer_s"] > 0


@pytest.mark.slow  # every part, the sweep and the server's loads: minutes of CPU (the sibling above runs two parts)
def test_device_check_smoke_passes_every_part(tmp_path: Path, device_check: ModuleType) -> None:
    """`benchmarks/device_check.py --smoke`: a row for every part in its JSON, each passed; PyTorch's parts are
    skipped, with the reason, only where torch (or transformers) is not installed."""
    proc, result = device_check_smoke(tmp_path / "check.json", "--variants", timeout=570)
    assert result, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = result["parts"]
    missing = {name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None}
    may_skip = ({"torch_train"} if "torch" in missing else set()) | ({"hf_generate"} if missing else set())
    assert list(parts) == list(device_check.PARTS)
    for name, part in parts.items():
        expected = {"ok", "skipped"} if name in may_skip else {"ok"}
        assert part["status"] in expected, (name, part.get("error"), part["log_tail"][-15:])
        assert part["status"] == "ok" or "not installed" in part["error"]
        assert Path(part["log"]).is_file()
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert parts["tests"]["metrics"]["passed"] >= 4 and not parts["tests"]["metrics"].get("failed")  # 2 devices ran
    assert parts["train"]["metrics"]["tokens_per_s"] > 0 and parts["serve"]["metrics"]["clients4_tokens_per_s"] > 0
    profile = parts["train"]["details"]["profile"]
    assert profile["top_ops"] and profile["device_busy_ms_per_step"] > 0
    assert parts["train"]["metrics"]["optimizer_s"] > 0
    assert parts["serve"]["metrics"]["clients1_ttft_p50_s"] > 0 and parts["serve"]["metrics"]["clients4_itl_p50_s"] > 0
    # the sweep's candidates (--smoke's two: a loss layout, accumulation with loops in command buffers) against the
    # recipe, each in the same process; GPT-2 medium's row (a tiny model under --smoke)
    sweep = parts["train_sweep"]["metrics"]
    assert sweep["loss_chunk0_ratio"] > 0 and sweep["accumulate_2_loops_in_graphs_ratio"] > 0
    assert not parts["train_sweep"]["details"]["errors"] and parts["train_medium"]["metrics"]["tokens_per_s"] > 0
    # PyTorch's ratios where it runs; the sweep's two to the recipe; the server's one client to generate alone,
    # many clients to one, and each load (1 and 4 clients) to the engine alone with as many at once
    assert len(result["comparisons"]) == (0 if "torch" in missing else 1) + (0 if missing else 2) + 6
    assert parts["serve"]["metrics"]["clients4_cpu_us_per_token_front_ends"] > 0


def test_the_guides_table_gives_each_parts_own_time_limit(device_check: ModuleType) -> None:
    """docs/accelerators.md's table of parts lists every part, in the order they run, with the limit the script
    gives it (it once said 90 s for `generate` after the script had given it 140)."""
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\d+) \|$", (ROOT / "docs" / "accelerators.md").read_text(), re.M)
    assert [name for name, _ in rows] == list(device_check.PARTS)
    assert {name: float(limit) for name, limit in rows} == device_check.FULL.limits


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="torch and transformers are not installed")
def test_device_check_runs_the_pytorch_parts_at_smoke_shapes(tmp_path):
    """benchmarks/device_check.py's PyTorch parts (the PyTorch training baseline, eager under --smoke, and
    transformers' generate), at --smoke's shapes: here, where torch is installed."""
    proc, result = device_check_smoke(tmp_path / "check.json", "--parts", "torch_train,hf_generate", timeout=300)
    assert proc.returncode == 0 and result, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = result["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {"torch_train": "ok", "hf_generate": "ok"}, parts
    assert parts["torch_train"]["metrics"]["tokens_per_s"] > 0 and parts["hf_generate"]["summary"]
