"""`python -m mk <command>`: the toolkit's command line.

Each command lives in its own module under `mk.cli` exposing `add_parser(subparsers)` (which
registers the command and sets `func`) so commands stay independent. Errors that are the user's
input (a bad checkpoint, an unknown config, an overflowing plan) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# command module -> commands it registers
COMMAND_MODULES = [
    "mk.cli.generate",     # generate
    "mk.cli.checkpoint",   # synth, logits, load
    "mk.cli.kernel",       # check, aot
    "mk.cli.simulate",     # simulate
    "mk.cli.notebooks",    # notebooks
]


def _quiet_libtpu():
    # libtpu warns about TPU_ACCELERATOR_TYPE / worker hostnames when no TPU is attached.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mk", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command not built yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    _quiet_libtpu()
    from mk.errors import UserError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
