"""`msaserve` command line. Each subcommand lives in its own module with `register(subparsers)`."""

import argparse
import sys
from importlib import import_module

# Subcommand modules under msaserve.platform.cli; each defines register(subparsers), which adds
# its parser and sets `func(args) -> int` as the default.
COMMANDS = ["generate", "deploy_config", "cluster", "serve", "chat", "bench", "convert"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msaserve", description="Serve long-context MSA models (see README.md)."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        import_module(f"msaserve.platform.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
