"""Errors that describe bad user input. The CLI prints them as one line and exits 2."""
from __future__ import annotations

import os


class UserError(Exception):
    """Base class: the message names the file, tensor, key or parameter at fault."""


def describe_os_error(e: OSError) -> str:
    """"'/x/y': No such file or directory" for an OSError about a path (one line)."""
    what = e.strerror or str(e)
    if e.filename2 is not None:
        return f"{os.fspath(e.filename)!r} -> {os.fspath(e.filename2)!r}: {what}"
    return f"{os.fspath(e.filename)!r}: {what}"


def writable_path(path, option: str) -> str:
    """Check that a file `path` can be created (its directory exists and is writable); returns it.
    Raises UserError naming `option` otherwise, before any heavy work is done."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UserError(f"{option}: {path!r} is a directory, expected a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"{option}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{option}: directory {parent!r} is not writable")
    return path


def creatable_dir(path, option: str) -> str:
    """Create directory `path` (and its parents) now, or raise UserError naming `option`."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{option}: {path!r} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"{option}: cannot create directory {describe_os_error(e)}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"{option}: directory {path!r} is not writable")
    return path
