"""How a ``kvring`` command ends when something goes wrong: one line on stderr,
``kvring: error: WHAT IS WRONG ... WHAT TO DO``, and a non-zero exit status; no traceback.

- A usage mistake (a bad flag value, an unknown option, a missing argument: click's
  ``UsageError``, which ``typer.BadParameter`` is) exits 2 and names the command's ``--help``.
- A failure a command foresaw (``KVRingError``: etcd or a cluster that cannot be reached or
  used, a trace file that is not a trace, a node that would not drain, ...) exits 1.
- Anything else is a failure nobody foresaw: its type and message (which may span lines, e.g.
  a vLLM engine's log tail), exit 1.
- Ctrl-C, SIGTERM and SIGHUP, once the run has stopped what it started
  (``kvring.local.signals``): ``kvring: stopped by SIGHUP``, exit 128 + the signal's number.

``-v``/``--verbose`` (``kvring -v COMMAND``, and the ``-v`` of commands that have one) logs at
DEBUG and prints the traceback above the line: verbose means the root logger is at DEBUG.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from collections.abc import Callable

import typer

from kvring.common.errors import KVRingError
from kvring.local.signals import Stopped

# The parser's exceptions, from where typer.BadParameter lives (click's, which typer vendors as
# typer._click from 0.2x on).
_parser_errors = sys.modules[typer.BadParameter.__module__]
ClickException = _parser_errors.ClickException
UsageError = _parser_errors.UsageError
NoArgsIsHelpError = _parser_errors.NoArgsIsHelpError

PROG = "kvring"
USAGE_EXIT = 2
FAILURE_EXIT = 1


class CommandFailed(KVRingError):
    """A command could not do what it was asked; the message says what is wrong and what to do."""


def verbose() -> bool:
    """Whether this run asked for details (``-v``)."""
    return logging.getLogger().isEnabledFor(logging.DEBUG)


def say(message: str) -> None:
    """Print one line on stderr; a terminal that is gone (SIGHUP) is not an error of its own."""
    try:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def run_app(command: Callable[..., object], args: list[str] | None = None) -> int:
    """Run the click/typer ``command`` on ``args`` (default: ``sys.argv[1:]``); its exit status."""
    try:
        result = command(args=args, prog_name=PROG, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except NoArgsIsHelpError as exc:  # `kvring` or `kvring bench` alone: the help
        print(exc.format_message())
        return USAGE_EXIT
    except UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        say(f"error: {_one_line(exc.format_message())}{hint}")
        return exc.exit_code
    except ClickException as exc:
        say(f"error: {_one_line(exc.format_message())}")
        return exc.exit_code
    except typer.Abort:
        say("aborted")
        return FAILURE_EXIT
    except KeyboardInterrupt:
        say("stopped by SIGINT")
        return 128 + signal.SIGINT
    except Stopped as exc:
        say(str(exc))
        return exc.exit_code
    except KVRingError as exc:
        if verbose():
            traceback.print_exc()
        say(f"error: {_one_line(exc)}")
        return FAILURE_EXIT
    except Exception as exc:  # noqa: BLE001 (the last resort: still no traceback unless asked)
        if verbose():
            traceback.print_exc()
        say(f"error: {type(exc).__name__}: {exc}"
            + ("" if verbose() else f"\n{PROG}: (an unexpected error: `{PROG} -v ...` shows its traceback)"))
        return FAILURE_EXIT
