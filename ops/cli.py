"""The `tokenbus` command line: the product's commands, registered by the modules that implement
them, then the commands other packages add through the entry-point group tokenbus.commands (the
lab's benchmarks, simulator and chaos scenarios, where it is installed)."""
import argparse
import asyncio
import importlib.metadata
import os
import sys

from ops import bus, chat, commands, drain, inspector, logs, models, records, replay, status, usage

ENVIRONMENT = """environment:
  TOKENBUS_HOME     where tokenbus keeps its models and the data and logs of `tokenbus up`
                    (default: ~/.cache/tokenbus; logs in $TOKENBUS_HOME/data/logs, see `tokenbus logs`)
  TOKENBUS_API_KEY  the API key of `tokenbus chat` and `tokenbus bench`"""
COMMANDS = (models.register, commands.generate, commands.evaluate, commands.plan, commands.up, bus.register,
            logs.register, chat.register, status.register, usage.register, inspector.register, replay.register,
            records.register, drain.register)
GROUP = "tokenbus.commands"                # entry points: NAME = "module:function", function(subparsers)


class Help(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help names it already or there is none."""
    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (of any depth) use Help too."""
    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", Help)
        super().__init__(*args, **kw)


def version() -> str:
    try:
        return importlib.metadata.version("tokenbus")
    except importlib.metadata.PackageNotFoundError:      # run from a source tree that was never installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="tokenbus", description="LLM serving over NATS JetStream.", epilog=ENVIRONMENT)
    p.add_argument("--version", action="version", version=f"tokenbus {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    for entry in importlib.metadata.entry_points(group=GROUP):
        register = loaded(entry)
        if register:
            register(sub)
    return p


def loaded(entry: importlib.metadata.EntryPoint):
    """The register function of an entry point; None when its package is not installed (the Docker
    image ships without the lab)."""
    try:
        return entry.load()
    except ModuleNotFoundError as e:
        if e.name and (entry.module == e.name or entry.module.startswith(f"{e.name}.")):
            return None
        raise


class QuietInterruptPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio.run's loops, minus one false alarm: Ctrl-C cancels the main task from a signal handler,
    which Python runs between two bytecodes, possibly inside a callback that has just checked that
    its future is not done and then sets its result (`_sock_connect_cb`, on CPython 3.11). That
    InvalidStateError is the interrupt itself, not a fault: the command is stopping anyway."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        loop.set_exception_handler(quiet_interrupted)
        return loop


def quiet_interrupted(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if not isinstance(context.get("exception"), asyncio.InvalidStateError):
        loop.default_exception_handler(context)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    asyncio.set_event_loop_policy(QuietInterruptPolicy())
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"tokenbus: {e}")
    except KeyboardInterrupt:                     # Ctrl-C: a quiet stop, never a traceback
        sys.exit(130)
    except BrokenPipeError:                       # `tokenbus logs | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except RuntimeError as e:
        from workers.models.catalogue import PullError  # imported here: torch is slow to import

        if not isinstance(e, PullError):
            raise
        sys.exit(f"tokenbus: {e}")


if __name__ == "__main__":
    main()
