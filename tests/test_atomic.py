import json
import os

import pytest

from accelerate_ssl.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_replace_the_target_and_leave_no_temporary(tmp_path):
    target = tmp_path / "meta.json"
    atomic_write_text(target, "old")
    atomic_write_json(target, {"b": 1, "a": 2}, sort_keys=True)
    assert json.loads(target.read_text()) == {"a": 2, "b": 1} and target.read_text().index('"a"') < target.read_text().index('"b"')
    assert sorted(os.listdir(tmp_path)) == ["meta.json"]
    nested = tmp_path / "new" / "folder" / "r.json"  # a results path in a folder that does not exist yet
    atomic_write_json(nested, {"x": 1})
    assert json.loads(nested.read_text()) == {"x": 1} and os.listdir(nested.parent) == ["r.json"]


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "data.bin"
    atomic_write_bytes(target, b"complete")

    class Unwritable:  # fails inside f.write, after the temporary file was created
        pass

    with pytest.raises(TypeError):
        atomic_write_bytes(target, Unwritable())
    assert target.read_bytes() == b"complete"
    assert sorted(os.listdir(tmp_path)) == ["data.bin"]


def test_committed_results_hold_no_absolute_paths():
    """Result JSONs travel between machines: no string in them may name an absolute path of the machine that ran them."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "benchmarks" / "results").glob("*.json")) + sorted((root / "benchmarks").glob("prior_runs/*/*.json"))
    assert len(files) >= 8
    absolute = re.compile(r"(?<![\w./:-])/(?=[\w.])|(?<=:)/(?=[\w.])")

    def strings(obj):
        if isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from strings(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from strings(v)

    for f in files:
        bad = [s for s in strings(json.loads(f.read_text())) if absolute.search(s)]
        assert not bad, f"{f.name}: {bad[:3]}"


def test_portable_paths_and_write_results(tmp_path):
    import json
    import sys

    from accelerate_ssl.results import portable, write_results

    obj = {"command": f"{sys.executable} benchmarks/x.py --out {tmp_path}/results/x.json",
           "spec": f"checkpoint:{tmp_path}/assets/p.safetensors", "url": "https://huggingface.co/timm/x",
           "rate": "3/4 it/s", "nested": [f"{tmp_path}/a b", 1.5]}
    assert portable(obj, tmp_path) == {"command": "python benchmarks/x.py --out results/x.json",
                                       "spec": "checkpoint:assets/p.safetensors", "url": "https://huggingface.co/timm/x",
                                       "rate": "3/4 it/s", "nested": ["a b", 1.5]}
    write_results(tmp_path / "r.json", obj, tmp_path)
    assert json.loads((tmp_path / "r.json").read_text())["spec"] == "checkpoint:assets/p.safetensors"


def test_every_writer_goes_through_atomic_py():
    """No module of the library, its integrations, benchmarks or examples renames files into place by itself:
    every write that must not be seen half-done uses accelerate_ssl.atomic (temporary + fsync + rename)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("accelerate_ssl", "integrations", "benchmarks", "examples"):
        for file in (root / folder).rglob("*.py"):
            if file.name == "atomic.py":
                continue
            for n, line in enumerate(file.read_text().splitlines(), 1):
                if re.search(r"\bos\.(replace|rename)\(|\.rename\(|\.replace\(tmp", line):
                    offenders.append(f"{file.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "hand-rolled atomic writes (use accelerate_ssl.atomic):\n" + "\n".join(offenders)


def test_atomic_path_leaves_the_target_untouched_on_error(tmp_path):
    from accelerate_ssl.atomic import atomic_path

    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    try:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    except RuntimeError:
        pass
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]
    with atomic_path(target, suffix=".png") as tmp:
        assert tmp.name.endswith(".png")
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and list(tmp_path.iterdir()) == [target]
