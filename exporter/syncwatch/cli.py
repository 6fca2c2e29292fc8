"""``syncwatch`` command line: one subcommand per module, every flag with a SYNCWATCH_* twin."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module providing ``register(subparsers)``; the module's parser sets ``func``.
SUBCOMMANDS = {
    "daemon": "syncwatch.daemon.main",
    "demo": "syncwatch.sim.demo",
    "jct": "syncwatch.analysis.jct",
    "diagnose": "syncwatch.analysis.diagnose",
    "project": "syncwatch.analysis.project",
    "report": "syncwatch.analysis.report",
    "rules": "syncwatch.rules.main",
    "run": "syncwatch.instrument.run",
    "stack": "syncwatch.stack",
}

EXIT_BROKEN_PIPE = 128 + 13  # the status of a command killed by SIGPIPE, as the shell reports it

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """``--path.sysfs`` -> ``SYNCWATCH_PATH_SYSFS``."""
    return "SYNCWATCH_" + flag.lstrip("-").replace("-", "_").replace(".", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str, **kw) -> argparse.Action:
    """Add ``flag`` whose default can come from its environment twin (see ``env_name``).

    The help text names the twin and the default (where there is one), so ``--help`` documents
    both.
    """
    env = kw.pop("env", None) or env_name(flag)
    action = kw.get("action")
    boolean = action in ("store_true", argparse.BooleanOptionalAction)
    if env in os.environ:
        raw = os.environ[env]
        if boolean:
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                parser.error(f"{env}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
            kw["default"] = low in _TRUE
        else:
            conv = kw.get("type", str)
            try:
                kw["default"] = conv(raw)
            except (TypeError, ValueError) as e:
                parser.error(f"{env}={raw!r}: {e}")
    # no default (None, "") is not printed: the help text says what happens without the flag
    shown = not boolean and kw.get("default") not in (None, "")
    suffix = f"[env {env}" + ("; default: %(default)s]" if shown else "]")
    return parser.add_argument(flag, help=f"{help} {suffix}", **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="syncwatch",
        description="Make synchronization coupling in distributed training visible and alertable.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"syncwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (``syncwatch diagnose ... | head``): stop quietly, as a command killed
        # by SIGPIPE would. stdout goes to /dev/null so the interpreter's final flush of what is
        # still buffered does not raise again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
