"""`file_lock.exclusive`: a second holder is told it waits, then gets the lock once the first
lets go (flock locks belong to the open file, so two opens in one process contend as two
processes do)."""

import threading
import time

from vconsole.engine.worker import file_lock


def test_a_second_holder_waits_is_told_so_and_gets_the_lock_after_the_first(tmp_path):
    path = tmp_path / "entry.lock"
    told: list[str] = []
    order: list[str] = []
    got_in = threading.Event()

    def second() -> None:
        with file_lock.exclusive(path, lambda: told.append("waiting")):
            order.append("second")
            got_in.set()

    with file_lock.exclusive(path, lambda: told.append("first waited")):
        t = threading.Thread(target=second)
        t.start()
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)                  # until the second has tried and been told
        assert not got_in.wait(0.2)          # ... and blocked while the first holds it
        order.append("first")
    t.join(10)
    assert order == ["first", "second"] and told == ["waiting"]
    with file_lock.exclusive(path, lambda: told.append("third waited")):
        pass                                  # free again: nobody waits
    assert told == ["waiting"]
