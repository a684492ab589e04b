"""Progress for the slow, silent parts of a start: loading or converting weights, building kernels.

On a terminal (stderr is a TTY) a tqdm bar; otherwise (a log file, a service, a test) one INFO log
line when the work starts, so logs stay free of bar redraws. `PAGODA_NO_PROGRESS=1` turns the bars
off everywhere. Any layer may use it (base); it imports tqdm only when a bar is drawn.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterable, Iterator, TypeVar

logger = logging.getLogger("pagoda.progress")
T = TypeVar("T")


def _bars_on(file: IO[str]) -> bool:
    if os.environ.get("PAGODA_NO_PROGRESS") == "1":
        return False
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False


def iterate(items: Iterable[T], total: int | None, desc: str, unit: str = "it",
            file: IO[str] | None = None) -> Iterator[T]:
    """`items`, with a bar on a terminal, else one log line naming `desc` and the total."""
    file = file if file is not None else sys.stderr
    if not _bars_on(file):
        logger.info("%s%s", desc, f" ({total} {unit})" if total else "")
        yield from items
        return
    from tqdm import tqdm

    with tqdm(items, total=total, desc=desc, unit=unit, file=file, leave=False, dynamic_ncols=True) as bar:
        yield from bar


@contextmanager
def activity(desc: str, expected_s: float | None = None, file: IO[str] | None = None) -> Iterator[None]:
    """Work that reports no steps (a compiler run): an elapsed-time bar on a terminal, else one log line."""
    file = file if file is not None else sys.stderr
    hint = f" (about {expected_s:.0f} s, once)" if expected_s else ""
    if not _bars_on(file):
        logger.info("%s%s", desc, hint)
        yield
        return
    from tqdm import tqdm

    done = threading.Event()
    bar = tqdm(total=None, desc=desc + hint, bar_format="{desc}: {elapsed}", file=file, leave=False)

    def tick() -> None:
        while not done.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="pagoda-progress", daemon=True)
    ticker.start()
    start = time.monotonic()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
        logger.debug("%s: %.1f s", desc, time.monotonic() - start)
