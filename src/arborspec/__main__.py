"""The console script `arborspec`, also `python -m arborspec`: the light commands (console.py) answered without
torch, every other one by cli.py."""
from __future__ import annotations

import sys

from .console import COMMAND_HELP, LIGHT, add_models_arguments, cmd_models, is_kept, print_kept, run_command, top_parser


def full_main(argv: list[str]) -> int:
    from .cli import main  # torch, transformers, the policies: 4-5 s
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMAND_HELP and argv[0] not in LIGHT:
        try:  # Ctrl-C in the seconds of importing printed a 60-line traceback; it is an interruption like any other
            if is_kept(argv):  # --help, `methods`: kept from the first time (console.py)
                return print_kept(argv, full_main)
            return full_main(argv)
        except KeyboardInterrupt:
            print("arborspec: interrupted", file=sys.stderr)
            return 130
    parser, commands = top_parser()
    add_models_arguments(commands["models"])
    args = parser.parse_args(argv)  # anything but `models` has exited here: help, version or a usage error
    return run_command(cmd_models, args)


if __name__ == "__main__":
    sys.exit(main())
