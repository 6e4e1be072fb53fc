"""What the docs and the command line tell a user agrees with the code: the demo's default prior is the one `priors
list` calls the demo's, and the demo says when its reference was measured on another setup."""

from __future__ import annotations

import argparse

from accelerate_ssl import demo
from accelerate_ssl.priors.catalog import RECOMMENDED


def test_priors_list_names_the_demo_default_it_really_uses():
    named = [spec for spec, about, _ in RECOMMENDED if "demo" in about]
    assert named == [demo.DEFAULT_PRIOR], named
    # a prior trained on the benchmarks' own images is said to be an upper bound there
    for spec, about, _ in RECOMMENDED:
        if spec.startswith("shipped:fashion-mnist"):
            assert "upper bound" in about, spec


def test_the_demo_says_when_its_reference_was_measured_on_another_setup():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = parser.parse_args([])
    same = {"speedup_cpu": {"speedup": 3.0},
            "machine": {"torch": demo.REFERENCE["torch"], "cpu_capability": demo.REFERENCE["cpu_capability"]}}
    assert "another setup" not in demo._reference_line(defaults, same)
    other = {"speedup_cpu": {"speedup": 3.0}, "machine": {"torch": "2.14.1+cu130", "cpu_capability": "AVX2"}}
    line = demo._reference_line(defaults, other)
    assert f"torch 2.14.1+cu130 here, {demo.REFERENCE['torch']} there" in line
    assert f"cpu capability AVX2 here, {demo.REFERENCE['cpu_capability']} there" in line
    assert "inside the 95 % interval" in line  # still placed, with the caveat


def test_the_reference_setup_is_the_committed_measurements():
    import json
    from pathlib import Path

    result = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "demo.json").read_text())
    assert demo.REFERENCE["torch"] == result["machine"]["torch"]
    assert demo.REFERENCE["cpu_capability"] == result["machine"]["cpu_capability"]
