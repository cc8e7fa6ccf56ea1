"""Errors caused by the user's input, phrased for the user: each names the file or key and what to do."""


class WsidinoError(Exception):
    """Bad input or a bad environment. The CLI prints the message (no traceback) and exits with code 2."""


# Exit codes of the `wsidino` commands: done, a stage failed (rerun to resume), bad input (fix it first).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
