"""`rundir.check_not_foreign`: a work directory is a run's, empty, or refused before training writes into it."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxgpt.errors import UserError
from jaxgpt.train.rundir import METRICS_FILE, check_not_foreign


def test_a_directory_of_other_files_is_refused_and_a_runs_files_are_not(tmp_path: Path) -> None:
    check_not_foreign(tmp_path)  # empty
    for name in ("checkpoints", "corrupt-checkpoints", "tensorboard"):
        (tmp_path / name).mkdir()
    (tmp_path / METRICS_FILE).write_text("")
    check_not_foreign(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    check_not_foreign(tmp_path)  # a run's directory may hold a user's notes beside it
    other = tmp_path / "other"
    other.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (other / name).write_text("")
    with pytest.raises(UserError, match=r"already holds files a jaxgpt run did not write \(a.txt, b.txt, c.txt, "
                                        r"\.\.\.\): choose an empty or new --config.workdir"):
        check_not_foreign(other)
