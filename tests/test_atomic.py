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


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "data.bin"
    atomic_write_bytes(target, b"complete")

    class Unwritable:  # fails inside f.write, after the temporary file was created
        pass

    with pytest.raises(TypeError):
        atomic_write_bytes(target, Unwritable())
    assert target.read_bytes() == b"complete"
    assert sorted(os.listdir(tmp_path)) == ["data.bin"]
