"""`python -m tilehal doctor`: the environment report (see tilehal.doctor)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilehal", description="tilehal command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="devices, compilers, backends, installed TileStack packages, import-name clashes")
    parser.parse_args(argv)
    from .doctor import main as doctor

    return doctor()


if __name__ == "__main__":
    sys.exit(main())
