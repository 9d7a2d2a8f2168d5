"""`python -m mk <command>`: the toolkit's command line.

Each command lives in its own module under `mk.cli` exposing `add_parser(subparsers)` (which
registers the command and sets `func`) so commands stay independent. Errors that are the user's
input (a bad path, id or value, an unknown config, an overflowing plan) print one line
`error: ...` naming the culprit and exit 2; argparse's own complaints do the same.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys

# command module -> commands it registers
COMMAND_MODULES = [
    "mk.cli.generate",     # generate
    "mk.cli.checkpoint",   # synth, logits, load
    "mk.cli.kernel",       # check, aot, compile-time
    "mk.cli.simulate",     # simulate
    "mk.cli.microbench",   # microbench
    "mk.cli.notebooks",    # notebooks
    "mk.cli.bench",        # bench
    "mk.cli.results",      # results
    "mk.cli.sweep",        # sweep
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`error: python -m mk check: argument --batch: ...`)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


# "--prompt-tokens -1,5": argparse takes a value that starts with '-' for an option unless it is a
# plain negative number, so the user would hear "expected one argument" instead of what is wrong
# with the ids. A value that looks like numbers ('-1,5', '-2 3', '-0.5') is glued to its option.
_NUMBERS = re.compile(r"^-\d[\d.,\s-]*$")


def _glue_negative_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if out and _NUMBERS.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m mk", description=__doc__.splitlines()[0])
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
    from mk.errors import UserError, describe_os_error

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(_glue_negative_values(argv))
    except SystemExit as e:                       # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    args.argv = argv                              # what a record names as its command
    from mk.cli.common import use_virtual_devices
    if getattr(args, "coordinator", None) is None:       # one process: --mesh N on CPU = N virtual devices
        use_virtual_devices(getattr(args, "mesh", None))
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                          # a path the user named: missing, unwritable, ...
        if getattr(e, "filename", None) is None:
            raise
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
