"""Peak anonymous memory of this process, sampled in a thread (shared by the benchmarks).

Anonymous RSS (``RssAnon``) leaves out file-backed pages, so memory-mapped dumps do not count.
"""

from __future__ import annotations

import threading
import time


class AnonPeak:
    """Samples the process's anonymous RSS (RssAnon) in a thread; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self) -> AnonPeak:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
