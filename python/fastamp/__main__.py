"""``python -m fastamp doctor`` (or the ``fastamp`` console script)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fastamp", description="fastamp command line")
    sub = ap.add_subparsers(dest="command", required=True)
    doc = sub.add_parser(
        "doctor", help="check the environment and self-test every op on every device"
    )
    doc.add_argument("--quiet", action="store_true", help="print only problems")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "doctor":
        from fastamp.doctor import run

        return run(quiet=args.quiet)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
