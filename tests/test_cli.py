import subprocess
import sys

import pytest

from accelerate_ssl.cli import COMMANDS, main


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


#: every verb (and sub-verb) -> options its help must list: the shared grammar (--data, --prior, --out, --seed, --json)
VERBS = {
    ("priors",): ["--json"],
    ("precompute",): ["--prior", "--weights", "--data", "--out", "--json"],
    ("store",): ["verify"],
    ("store", "verify"): ["--json"],
    ("demo",): ["--prior", "--out", "--seed", "--json"],
    ("distill",): ["--data", "--weights", "--seed", "--out", "--json"],
    ("compact",): ["distill", "info"],
    ("compact", "distill"): ["--data", "--images", "--seed", "--out"],
    ("compact", "info"): [],
}


def test_every_verb_and_sub_verb_has_a_help_that_lists_the_shared_options(capsys):
    assert {v[0] for v in VERBS} == set(COMMANDS)
    for argv, options in VERBS.items():
        out = _help(capsys, list(argv))
        assert argv[-1] in out
        for option in options:
            assert option in out, (argv, option)


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_import_is_light():
    code = "import sys, accelerate_ssl; print(any(m in sys.modules for m in ('timm', 'open_clip', 'lightly')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
