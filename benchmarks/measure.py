"""Measuring helpers shared by the benchmarks (psutil: ``pip install "accelerate-ssl[test]"``)."""

from __future__ import annotations

import threading
import time


class PeakRSS:
    """Peak resident set size of this process while the block runs, sampled every ``interval`` seconds in a
    background thread: ``base`` and ``peak`` in bytes, ``mib`` the peak above the value at entry."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.interval, self._proc = interval, psutil.Process()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.mib = (self.peak - self.base) / 2**20
