"""Running a test's work on several threads at once: every thread starts together (a barrier),
and what any of them raised is returned to the test, which asserts on it in the main thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_together(work: Callable[[int], None], threads: int) -> list[BaseException]:
    """``work(k)`` on ``threads`` threads (k = 0, 1, ...), started together; what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def run(k: int) -> None:
        try:
            barrier.wait()
            work(k)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors
