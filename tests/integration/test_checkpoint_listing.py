"""The checkpointer as a reader of a run another process is still writing."""

import threading

import jax.numpy as jnp

from jaxgpt.io.checkpoint import Checkpointer


def test_listing_a_run_whose_trainer_deletes_old_steps_never_fails(tmp_path):
    """A server following a run lists its steps while the trainer's keep policy deletes the oldest: a step that
    vanishes while listed is listed again, not an error (it was one line of `--follow` noise per race)."""
    state = {"params": {"w": jnp.zeros((64, 64))}, "opt_state": {"count": jnp.zeros((), jnp.int32)}}
    failures, listed, stop = [], set(), threading.Event()

    def follow() -> None:
        while not stop.is_set():
            try:
                reader = Checkpointer(tmp_path, read_only=True)
                listed.add(reader.latest_step())
                reader.close()
            except Exception as e:  # reported by the assertion below
                failures.append(e)

    writer = Checkpointer(tmp_path, keep=2, keep_best=False)
    writer.save({**state, "step": 1}, {})
    writer.wait()
    reader_thread = threading.Thread(target=follow)
    reader_thread.start()
    try:
        for step in range(2, 25):
            writer.save({**state, "step": step}, {})
            writer.wait()
    finally:
        stop.set()
        reader_thread.join()
    writer.close()
    assert not failures, failures
    assert len(listed) > 3 and writer.all_steps() == [23, 24]
