"""Errors caused by the user's input, phrased for the user: each names the file or key and what to do."""


class WsidinoError(Exception):
    """Bad input or a bad environment. The CLI prints the message (no traceback) and exits with code 2."""


# Exit codes of the `wsidino` commands: done, a stage failed (rerun to resume), bad input (fix it first).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class RunStopped(WsidinoError):
    """A run that stopped itself after saving its state (a checkpoint): diverging, or out of memory with nothing left
    to re-plan. Unlike bad input its output is kept; the CLI exits with EXIT_FAILED (fix the cause, rerun to resume)."""


def exit_code(err: WsidinoError) -> int:
    """EXIT_FAILED for a run that stopped itself (rerun to resume), EXIT_USAGE for bad input (fix it first)."""
    return EXIT_FAILED if isinstance(err, RunStopped) else EXIT_USAGE
