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


def machine(device=None, threads=None) -> dict:
    """What a results JSON records of the run: the code commit (``git rev-parse HEAD``, and whether the work tree
    differed from it), the device, the GPU driver when readable, torch, CUDA, cuDNN, the CPU's capability and count,
    torch's threads and the load average at the start."""
    import os
    import platform
    import subprocess
    from pathlib import Path

    import torch

    root = Path(__file__).resolve().parents[1]

    def git(*args) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    driver = None
    if cuda:
        try:
            driver = Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
        except (OSError, IndexError):
            try:
                driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                driver = None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "work_tree_differs": bool(status) if status is not None else None,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "driver": driver,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "torch_threads": threads or torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_start": os.getloadavg()}
