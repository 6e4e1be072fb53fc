"""benchmarks/overhead.py on tiny settings: it runs end to end (a fresh batch of store rows every step, as the
placeholder-index check requires) and reports what it measured."""

import json
import sys
from pathlib import Path

from scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_overhead_benchmark_tiny(tmp_path, fashion_mnist_available):
    sys.path.insert(0, str(BENCH))
    overhead = load_script("benchmarks/overhead.py", "overhead")
    out = tmp_path / "overhead.json"
    result = overhead.main(["--repeats", "2", "--warmup", "1", "--batch-size", "16", "--widths", "4,8",
                            "--store-rows", "200", "--cache", str(tmp_path / "cache"), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["time_ratio"] == result["time_ratio"] > 0
    assert len(written["step_seconds_all"]["rela"]) == len(written["step_seconds_all"]["plain"]) == 2
    # ReLA adds its head (parameters, gradients, optimiser state) and its saved activations: more memory, measured
    assert written["memory_bytes"]["rela"] > written["memory_bytes"]["plain"] > 0
    assert out.with_suffix(".png").is_file()
