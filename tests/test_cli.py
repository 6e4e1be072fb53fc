import subprocess
import sys

from accelerate_ssl.cli import COMMANDS, main


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        try:
            main([name, "--help"])
        except SystemExit as exit_:
            assert exit_.code == 0
        out = capsys.readouterr().out
        assert name in out


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_import_is_light():
    code = "import sys, accelerate_ssl; print(any(m in sys.modules for m in ('timm', 'open_clip', 'lightly')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
