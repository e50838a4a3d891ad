"""The `tilestack` command: doctor | demo | bench | profile."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tilestack", description="TileStack command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="devices, compilers, installed packages and live backends")
    sub.add_parser("demo", add_help=False,
                   help="long-context generation through kvpool + sparse attention (--help for options)")
    sub.add_parser("profile", add_help=False,
                   help="profile a model built from a config: markdown report + plot (--help for options)")
    b = sub.add_parser("bench", help="run the benchmark scripts of a checkout")
    b.add_argument("root", nargs="?", help="checkout root (default: current directory)")
    b.add_argument("--record", action="store_true", help="let each script write its results into docs/benchmarks/")
    args, rest = parser.parse_known_args(argv)
    if args.command not in ("demo", "profile") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "doctor":
        from .doctor import main as run
        return run()
    if args.command == "demo":
        from .demo import main as run
        return run(rest)
    if args.command == "profile":
        from .profiling import main as run
        return run(rest)
    from .bench import main as run
    return run(([args.root] if args.root else []) + (["--record"] if args.record else []))


if __name__ == "__main__":
    sys.exit(main())
