"""`pagedq` command line. Heavy imports (torch, transformers) happen inside the subcommands."""

from __future__ import annotations

import argparse
import sys


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    from worker.models.prepare import PrepareError, prepare

    try:
        path = prepare(args.name, args.out, force=args.force)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq",
        description="Redis-fed LLM inference with continuous batching on a paged KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    model = sub.add_parser("model", help="prepare local model folders")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prep = model_sub.add_parser("prepare", help="turn a bundled GGUF model into an HF folder (once)")
    prep.add_argument("name", choices=["smollm2"], help="which bundled model")
    prep.add_argument("--out", default=None, help="target folder (default ~/.cache/pagedq/models/...)")
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
