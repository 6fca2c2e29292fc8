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


class EnvError:
    """The default of a flag whose environment twin does not convert: ``--help`` shows the raw value."""

    def __init__(self, raw: str, message: str):
        self.raw, self.message = raw, message

    def __str__(self) -> str:
        return self.raw


# the value of a flag whose twin gave its default, until the command line gives the flag
_NOT_GIVEN = object()


class Parser(argparse.ArgumentParser):
    """Reports an ``EnvError`` only when its flag's command runs without the flag: a twin that two
    commands read differently (``SYNCWATCH_NODES``: ``project``'s list, ``jct``'s count) must not
    stop the other command, nor ``--help``. Notes in ``from_env`` (flag -> twin) each flag whose
    value its twin gave, for the errors about it (``named``)."""

    def parse_known_args(self, args=None, namespace=None):
        from_twin = [a for a in self._actions if getattr(a, "twin", None)]
        namespace = argparse.Namespace() if namespace is None else namespace
        for action in from_twin:  # argparse puts no default where the namespace holds a value
            if not hasattr(namespace, action.dest):
                setattr(namespace, action.dest, _NOT_GIVEN)
        parsed, rest = super().parse_known_args(args, namespace)
        from_env = vars(parsed).setdefault("from_env", {})  # a subcommand's parser filled it
        for action in from_twin:
            if getattr(parsed, action.dest) is _NOT_GIVEN:
                setattr(parsed, action.dest, action.default)
                from_env[action.option_strings[0]] = action.twin
        for value in vars(parsed).values():
            if isinstance(value, EnvError):
                self.error(value.message)
        return parsed, rest


def plain(doc: str) -> str:
    """A module docstring as ``--help`` text: without its reStructuredText double backticks."""
    return doc.replace("``", "")


def env_name(flag: str) -> str:
    """``--path.sysfs`` -> ``SYNCWATCH_PATH_SYSFS``."""
    return "SYNCWATCH_" + flag.lstrip("-").replace("-", "_").replace(".", "_").upper()


def named(args: argparse.Namespace, flag: str) -> str:
    """``flag`` as an error about its value names it: ``--udp``, or ``--udp (from SYNCWATCH_UDP)``
    where the value came from its environment twin, which a user who never typed the flag must
    be told of."""
    env = getattr(args, "from_env", {}).get(flag)
    return f"{flag} (from {env})" if env else flag


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str, **kw) -> argparse.Action:
    """Add ``flag`` whose default can come from its environment twin (see ``env_name``).

    The help text names the twin and the default (where there is one), so ``--help`` documents
    both. A twin that does not convert is reported by ``Parser`` once the flag's command runs;
    ``Parser`` notes one that gave the flag's value, for ``named``.
    ``empty_unset``: an empty twin counts as unset (``syncwatch-run``'s, as the ranks read them).
    """
    env = kw.pop("env", None) or env_name(flag)
    empty_unset = kw.pop("empty_unset", False)
    action = kw.get("action")
    boolean = action in ("store_true", argparse.BooleanOptionalAction)
    from_twin = env in os.environ and not (empty_unset and os.environ[env] == "")
    if from_twin:
        raw = os.environ[env]
        if boolean:
            low = raw.strip().lower()
            kw["default"] = (low in _TRUE if low in _TRUE | _FALSE else
                             EnvError(raw, f"{env}={raw!r}: expected one of 1/0, true/false, yes/no, on/off"))
        else:
            kw["default"] = _from_env(env, raw, kw.get("type", str), kw.get("choices"))
    # no default (None, "") is not printed: the help text says what happens without the flag
    shown = not boolean and kw.get("default") not in (None, "")
    suffix = f"[env {env}" + ("; default: %(default)s]" if shown else "]")
    added = parser.add_argument(flag, help=f"{help} {suffix}", **kw)
    added.twin = env if from_twin else None  # the twin that gave the default, for Parser
    return added


def _from_env(env: str, raw: str, conv, choices):
    """A twin's value as its flag would take it, checked as argparse checks a flag's (a value
    its ``type`` refuses, one outside ``choices``), else an ``EnvError``. argparse checks no
    default against ``choices``: ``SYNCWATCH_SCALING=Strong`` ran as neither weak nor strong."""
    try:
        value = conv(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        return EnvError(raw, f"{env}={raw!r}: {e}")
    if choices is not None and value not in choices:
        return EnvError(raw, f"{env}={raw!r}: invalid choice: {value!r} "
                             f"(choose from {', '.join(map(repr, choices))})")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
