"""Make tests/helpers and tests/reference importable, keep test runs on the CPU, share a small corpus and one
compile cache, mark each test with its tier (its folder) and that tier's time limit, and pick a CI lane's tests."""

import json
import os
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The tests' programs are tiny, so XLA:CPU spends most of a test in LLVM's optimisation passes, not in
    # running it: at level 0 they compile about 3.5x faster (CPU time of test_model.py's init, remat and dropout
    # tests: 270 s -> 78 s). Every comparison with a reference has a tolerance that holds at either level, and
    # subprocesses inherit the flag. Benchmarks and accelerator runs keep XLA's default.
    flags = ["--xla_backend_optimization_level=0"]
    if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11):
        # jaxlib 0.10's XLA can still emit its fusions as LLVM IR directly instead of through MLIR, whose
        # per-fusion pipelines took most of a test's compile there: tests/unit/generate/test_engine_speed.py,
        # one process, 131 compiles: 63.7 s -> 35.4 s of compiling, 92 s -> 54 s of CPU. (jaxlib 0.11 and
        # 0.12 have only the MLIR emitters and refuse the flag.)
        flags.append("--xla_cpu_use_fusion_emitters=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared character-level dataset of real Python source (read-only: shared by every test)."""
    from helpers import prepare_test_corpus

    return prepare_test_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def gpt2() -> object:
    """GPT-2's tokenizer, from the ranks file CI provisions (skipped where there is none: no network here)."""
    if not os.environ.get("JAXGPT_BPE_FILE"):
        pytest.skip("needs the GPT-2 ranks offline (JAXGPT_BPE_FILE, see .ci/provision_bpe.sh)")
    from jaxgpt.data.tokenizer import load_bpe

    return load_bpe("gpt2")


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One persistent compilation cache for every subprocess the tests start (train.py, jaxgpt commands, servers):
    each compiles the tiny model's programs once per run instead of once per process. JAX reads the variables
    when it is imported, so this process (imported already) keeps compiling in memory as before."""
    cache = str(tmp_path_factory.mktemp("xla"))
    names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"  # what jaxgpt.train.runtime sets
    yield cache
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


TESTS = Path(__file__).parent
# Each tier's time limit per test (pytest-timeout): room for a loaded 2-core CPU, where a unit test's setup (the
# 2x2x2 mesh's subprocess) took over 300 s at a load average of 16; a test marked slow gets the slow tier's, and
# a test's own `timeout` marker wins.
TIMEOUT_S = {"unit": 600, "integration": 900, "compile": 900, "slow": 1800}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lane", choices=("oldest", "newest"),
                     help="only the tests CI's lane of that name runs (tests/helpers/lanes.py, .ci/lanes.json)")
    parser.addoption("--write-lanes", metavar="PATH",
                     help="write the lane of each test file from .ci/durations/ (with --collect-only)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """pyproject's `-n auto` (pytest-xdist): a run whose paths all lie in tests/unit (`python -m pytest tests/unit`,
    the loop a developer runs, or a file of it) takes every core, as many workers as xdist counts (None: its
    count); any other run, CI's lanes included (they already run side by side, one per core), stays in one process
    (0). An explicit -n N wins."""
    unit = TESTS / "unit"
    paths = [Path(arg.split("::", 1)[0]).resolve() for arg in config.args]
    return None if paths and all(path.is_relative_to(unit) for path in paths) else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """In a CI lane, a test that skips for want of a package only the oldest lane installs, without the marker that
    sends it there, fails instead: it would otherwise run in neither lane (tests/helpers/lanes.py)."""
    report = (yield).get_result()
    if report.skipped and item.config.getoption("lane") and isinstance(report.longrepr, tuple):
        from helpers import lanes

        if package := lanes.unmarked_skip(str(report.longrepr[2]), (m.name for m in item.iter_markers())):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} needs {package}, which only CI's oldest lane installs: mark it "
                               "@pytest.mark.torch so that it runs there")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tier of each test from its folder (tests/unit, tests/integration, tests/compile), and its time limit;
    all of tests/compile is of what moved between JAX releases; then the lane's selection, if asked for."""
    from helpers import ROOT, lanes

    for item in items:
        tier = Path(item.path).relative_to(TESTS).parts[0]
        if tier in ("unit", "integration", "compile"):
            item.add_marker(tier)
        if tier == "compile":
            item.add_marker(lanes.BOTH)
        if item.get_closest_marker("timeout") is None and (limit := TIMEOUT_S.get(
                "slow" if item.get_closest_marker("slow") else tier)):
            item.add_marker(pytest.mark.timeout(limit))
    fixed = {item.nodeid: lanes.fixed_lanes(m.name for m in item.iter_markers()) for item in items}
    if path := config.getoption("write_lanes"):
        recorded = ROOT / ".ci" / "durations"
        split = lanes.split(fixed, lanes.read_durations(recorded), lanes.read_outside(recorded))
        Path(path).write_text(json.dumps(split, indent=1) + "\n")
    if lane := config.getoption("lane"):
        files = json.loads((ROOT / ".ci" / "lanes.json").read_text())["files"]
        keep = [lanes.in_lane(lane, item.nodeid, fixed[item.nodeid], files) for item in items]
        config.hook.pytest_deselected(items=[item for item, k in zip(items, keep, strict=True) if not k])
        items[:] = [item for item, k in zip(items, keep, strict=True) if k]
