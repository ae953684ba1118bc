"""``msprobe-mlflow``: one sub-command per module in ``msprobe_mlflow.commands``.

Each command module defines ``HELP`` (one line), ``DESCRIPTION`` (the ``--help`` text, with an example),
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Modules import heavy libraries inside ``run``,
so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = {
    "upload": "msprobe_mlflow.commands.upload",
    "compare": "msprobe_mlflow.commands.compare",
    "api-check": "msprobe_mlflow.commands.api_check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msprobe-mlflow",
        description="Precision debugging of PyTorch and MindSpore training, recorded in MLflow.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMAND_MODULES.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Runs a command; bad input (a ValueError, a missing file, a run MLflow does not know) is one line on
    stderr and exit code 2, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Exception as e:
        if isinstance(e, (ValueError, OSError)) or type(e).__name__ == "MlflowException":
            print(f"msprobe-mlflow {args.command}: error: {e}", file=sys.stderr)
            return USAGE_ERROR
        raise


if __name__ == "__main__":
    sys.exit(main())
