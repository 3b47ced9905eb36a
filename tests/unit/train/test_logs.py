"""metrics.jsonl as a run writes it: numbers kept, per-dataset scores one level down kept under their names."""

from __future__ import annotations

from pathlib import Path

from helpers import logged_records

from jaxgpt.train.logs import MetricsLog


def test_a_record_keeps_its_numbers_and_each_dataset_score_under_its_own_name(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, 0, {})
    log.write(7, {"val_loss": 0.5, "val_pairs": 3, "done": True, "note": "text",
                  "val_exact_match_by_dataset": {"count": 0.25, "reverse": 1.0}}, kind="eval")
    log.close()
    [record] = logged_records(tmp_path)
    record.pop("time")
    assert record == {"step": 7, "val_loss": 0.5, "val_pairs": 3.0, "val_exact_match_by_dataset/count": 0.25,
                      "val_exact_match_by_dataset/reverse": 1.0}


def test_without_tensorboard_the_records_are_the_same_and_no_event_file_is_written(tmp_path: Path) -> None:
    for name, tensorboard in (("on", True), ("off", False)):
        (tmp_path / name).mkdir()
        log = MetricsLog(tmp_path / name, 0, {}, tensorboard=tensorboard)
        log.write(5, {"train_loss": 2.5, "lr": 0.1})
        log.close()
    assert [{k: v for k, v in r.items() if k != "time"} for r in logged_records(tmp_path / "off")] == [
        {k: v for k, v in r.items() if k != "time"} for r in logged_records(tmp_path / "on")]
    assert list((tmp_path / "on" / "tensorboard").iterdir()) and not (tmp_path / "off" / "tensorboard").exists()
