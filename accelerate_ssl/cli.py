"""`accelerate-ssl` command line: one subcommand per job, each defined in the module that does the job.

Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; only the module
of the command being run is imported, so ``accelerate-ssl --help`` stays fast. Runs under
``accelerate launch -m accelerate_ssl.cli <command> ...`` as well: every process runs the command (precompute shares
its work among them), and what a command prints on stdout (its result: ``wrote ...``, ``ok``, the ``--json`` object)
is printed by the main process only; errors and warnings (stderr) come from every process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Optional, Sequence

# name -> (module that implements it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compact": ("accelerate_ssl.compact.cli", "distil unlabelled images into a compact parameterized store (Yu et al. (2025)), or inspect one"),
    "priors": ("accelerate_ssl.priors.catalog", "list recommended priors, show what a prior spec names, fetch its weights into the cache"),
    "precompute": ("accelerate_ssl.targets.precompute", "run a prior model over a data set once and write a TargetStore"),
    "store": ("accelerate_ssl.targets.verify", "check a TargetStore: `store verify <path>` reads every row and the file's checksum"),
    "demo": ("accelerate_ssl.demo", "ReLA's speed-up over plain BYOL on Fashion-MNIST, on CPU (table + PNG + JSON)"),
    "distill": ("accelerate_ssl.distill.cli", "synthesise a distilled warm-start set (SRe2L / DWA / FADRM) from a BatchNorm teacher"),
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The top-level parser; the arguments of ``command`` (if given) are loaded from its module."""
    parser = argparse.ArgumentParser(
        prog="accelerate-ssl",
        description="Cheaper representation learning: prior-model targets (ReLA), distilled and compact warm-start sets.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"accelerate-ssl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from .launch import is_main_process

    if is_main_process():
        return int(args._run(args) or 0)
    # another process of `accelerate launch` / torchrun: the same result as the main process's, printed once, there
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
