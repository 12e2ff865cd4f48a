"""Errors that reach the user as one line (the CLI prints it and exits 2)."""


class UserError(Exception):
    """A problem with the user's input: a bad path, option value or file.

    The CLI prints ``triclip: error: <message>`` and exits with status 2, no traceback.
    """


def first_line(err: BaseException, limit: int | None = 200) -> str:
    """The first line of ``err``'s message (at most ``limit`` characters), or its type's name when empty."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__
