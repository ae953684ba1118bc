"""The writer thread: steps go through every handler in order, a full queue makes training wait instead of
growing memory, and a failure loses only its own step."""
import queue
import threading
import time

import numpy as np
import pytest

from msprobe_mlflow.background import BackgroundStepWriter
from msprobe_mlflow.records import StepRecord


def record(step: int) -> StepRecord:
    return StepRecord(rank=0, step=step, level="L1", bounds=(0,), names=["w"], shapes=[(1,)],
                      values=np.zeros((1, 3), np.float32), directions=np.zeros(1, np.uint8))


def test_steps_reach_every_handler_in_submission_order():
    seen = []
    writer = BackgroundStepWriter([lambda r: seen.append(("dump", r.step)), lambda r: seen.append(("sink", r.step))])
    for step in range(5):
        writer.submit(lambda step=step: record(step))
    writer.close()
    assert seen == [(name, step) for step in range(5) for name in ("dump", "sink")]
    assert writer.errors == []


def test_a_full_queue_makes_submit_wait_until_the_writer_catches_up():
    taken, release, seen = threading.Event(), threading.Event(), []

    def handler(r):
        taken.set()
        assert release.wait(10)
        seen.append(r.step)

    writer = BackgroundStepWriter([handler], max_pending=2)
    writer.submit(lambda: record(0))
    assert taken.wait(10)  # the worker holds step 0 in the handler: the queue is empty
    writer.submit(lambda: record(1))
    writer.submit(lambda: record(2))  # the queue now holds 2: full
    with pytest.raises(queue.Full):  # no room: a submit waits (block=False says so at once) instead of growing
        writer.submit(lambda: record(3), block=False)
    blocked = threading.Thread(target=writer.submit, args=(lambda: record(3),))
    blocked.start()
    release.set()
    blocked.join(10)
    assert not blocked.is_alive()
    writer.close()
    assert seen == [0, 1, 2, 3]


def test_a_step_that_cannot_be_collected_is_reported_and_the_next_ones_are_written():
    written = []

    def broken():
        raise RuntimeError("device copy failed")

    writer = BackgroundStepWriter([lambda r: written.append(r.step)])
    writer.submit(lambda: record(0))
    writer.submit(broken)
    writer.submit(lambda: record(2))
    writer.flush()
    assert written == [0, 2]
    assert len(writer.errors) == 1 and "could not collect" in writer.errors[0] and "device copy failed" in \
        writer.errors[0]
    writer.close()


def test_a_failing_handler_does_not_stop_the_handlers_after_it_nor_the_next_steps():
    after = []

    def failing(r):
        if r.step == 1:
            raise OSError(28, "No space left on device")

    writer = BackgroundStepWriter([failing, lambda r: after.append(r.step)])
    for step in range(3):
        writer.submit(lambda step=step: record(step))
    writer.close()
    assert after == [0, 1, 2]
    assert len(writer.errors) == 1
    assert "failed on rank 0 step 1" in writer.errors[0] and "No space left on device" in writer.errors[0]


def test_close_flushes_is_idempotent_and_refuses_later_steps():
    seen = []
    writer = BackgroundStepWriter([lambda r: (time.sleep(0.05), seen.append(r.step))])
    for step in range(3):
        writer.submit(lambda step=step: record(step))
    writer.close()
    assert seen == [0, 1, 2]
    writer.close()
    writer.flush()  # nothing to wait for, returns
    with pytest.raises(RuntimeError, match="the writer was closed"):
        writer.submit(lambda: record(3))
