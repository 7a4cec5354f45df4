"""Command line: ``offpolicy <command>`` (console script) or ``python -m offpolicy <command>``.

Commands:
    demo      the mixed-fleet asynchronous RL demonstration on CPU (``offpolicy demo --help``)
    diagnose  check recorded sampler rollouts against the trainer (``offpolicy diagnose --help``)
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "the mixed-fleet asynchronous RL demonstration on CPU (see `offpolicy demo --help`)",
    "diagnose": "check recorded sampler rollouts against the trainer (see `offpolicy diagnose --help`)",
}


def _usage() -> str:
    lines = ["usage: offpolicy <command> [options]", "", "commands:"]
    lines += [f"  {name:<10}{text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from offpolicy.demo.cli import main as demo_main

        return demo_main(rest)
    if command == "diagnose":
        from offpolicy.diagnose.command import main as diagnose_main

        return diagnose_main(rest)
    print(f"offpolicy: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
