"""CI's split of the tests between its two lanes (tests/helpers/lanes.py): every test runs in at least one lane,
those needing one lane's packages run there, those of what moved between JAX releases in both, and the files of
the others go where the recorded durations balance the lanes."""

from __future__ import annotations

import pytest
from helpers import lanes


def test_markers_fix_the_lanes_of_a_test() -> None:
    assert lanes.fixed_lanes(["torch", "parametrize"]) == ("oldest",)
    assert lanes.fixed_lanes(["browser", "jax_release"]) == ("oldest",)  # needing a lane's packages wins
    assert lanes.fixed_lanes(["cuda_plugin", "jax_release"]) == ("newest",)
    assert lanes.fixed_lanes(["jax_release"]) == ("oldest", "newest")
    assert lanes.fixed_lanes(["slow"]) is None
    with pytest.raises(ValueError, match="both lanes"):
        lanes.fixed_lanes(["torch", "cuda_plugin"])


def test_a_skip_for_the_oldest_lanes_packages_needs_the_torch_marker() -> None:
    reason = "could not import 'datasets': No module named 'datasets'"
    assert lanes.unmarked_skip(reason, ["integration"]) == "datasets"
    assert lanes.unmarked_skip("could not import 'transformers.models': x", []) == "transformers"
    assert lanes.unmarked_skip(reason, ["torch", "integration"]) is None
    assert lanes.unmarked_skip("could not import 'schemathesis': x", []) is None  # both lanes install it
    assert lanes.unmarked_skip("needs the GPT-2 ranks offline", []) is None


def test_every_test_runs_in_a_lane_and_the_free_files_balance_them() -> None:
    tests = {"tests/a.py::t1": None, "tests/a.py::t2": None, "tests/b.py::t": None, "tests/c.py::t": None,
             "tests/hf.py::t": ("oldest",), "tests/gpu.py::t": ("newest",), "tests/ops.py::t": lanes.LANES}
    durations = {"oldest": {"tests/a.py::t1": 50.0, "tests/a.py::t2": 10.0, "tests/b.py::t": 40.0,
                            "tests/c.py::t": 20.0, "tests/hf.py::t": 30.0, "tests/ops.py::t": 5.0},
                 "newest": {"tests/gpu.py::t": 10.0, "tests/ops.py::t": 4.0}}
    split = lanes.split(tests, durations)
    # fixed: oldest 30 + 5, newest 10 + 4; then a.py (60) -> newest, b.py (40) -> oldest, c.py (20) -> newest
    assert split["files"] == {"tests/a.py": "newest", "tests/b.py": "oldest", "tests/c.py": "newest"}
    assert split["expected_s"] == {"oldest": 75, "newest": 94}
    for nodeid, fixed in tests.items():
        runs_in = [lane for lane in lanes.LANES if lanes.in_lane(lane, nodeid, fixed, split["files"])]
        assert runs_in == list(fixed or [split["files"][lanes.file_of(nodeid)]]), nodeid


def test_time_outside_pytest_counts_toward_its_lane() -> None:
    """A lane that spends longer installing (or runs more after its tests) gets fewer of the free files."""
    tests = {"tests/a.py::t": None, "tests/b.py::t": None, "tests/c.py::t": None}
    durations = {"oldest": {"tests/a.py::t": 50.0, "tests/b.py::t": 30.0, "tests/c.py::t": 20.0}, "newest": {}}
    assert lanes.split(tests, durations)["files"] == {"tests/a.py": "oldest", "tests/b.py": "newest",
                                                      "tests/c.py": "newest"}
    split = lanes.split(tests, durations, {"oldest": 0.0, "newest": 60.0})
    assert split["files"] == {"tests/a.py": "oldest", "tests/b.py": "oldest", "tests/c.py": "newest"}
    assert split["expected_s"] == {"oldest": 80, "newest": 80}


def test_a_file_no_recorded_split_names_runs_in_exactly_one_lane() -> None:
    runs_in = [lane for lane in lanes.LANES if lanes.in_lane(lane, "tests/new.py::t", None, {})]
    assert runs_in == [lanes.hashed_lane("tests/new.py")]
