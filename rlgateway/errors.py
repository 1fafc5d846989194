"""The command line's one error type."""


class CLIError(Exception):
    """A user mistake on the command line; the message says what to do. Exit status 2."""
