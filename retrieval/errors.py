"""Errors that reach the user as one line (the CLI prints it and exits 2)."""


class UserError(Exception):
    """A problem with the user's input: a bad path, option value or file.

    The CLI prints ``triclip: error: <message>`` and exits with status 2, no traceback.
    """
