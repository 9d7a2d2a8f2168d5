"""Errors that describe bad user input. The CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Base class: the message names the file, tensor, key or parameter at fault."""
