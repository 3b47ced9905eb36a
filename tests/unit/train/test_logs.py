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
