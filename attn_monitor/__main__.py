"""Command line: ``attn-monitor compare A B [--top N] [--heatmap out.png]``.

Also runs as ``python -m attn_monitor``. ``A`` and ``B`` are summaries written
by :func:`attn_monitor.report.archive.save_summary`; the table of per-head changes
goes to stdout. Exit status: 0 on success, 2 on bad arguments, unreadable
files or summaries that cannot be compared (with a one-line message on
stderr, no traceback).

Example:
    >>> main(["compare", "missing-a.pt", "missing-b.pt"])
    2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

PROGRAM = "attn-monitor"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Inspect attention entropy summaries saved by attn_monitor.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    compare = commands.add_parser(
        "compare",
        help="compare two saved summaries per layer and head",
        description=(
            "Compare two summaries of the same layers and heads (A = before, B = after): shift in mean and "
            "median normalised entropy (B - A) and the Wasserstein-1 distance between the distributions, "
            "largest change first. Entropy describes the shape of attention weights only; a shift says where "
            "to look, not whether the model got better."
        ),
    )
    compare.add_argument("a", metavar="A", help="reference summary file (save_summary)")
    compare.add_argument("b", metavar="B", help="summary file compared with A")
    compare.add_argument("--top", type=_positive_int, metavar="N", help="show only the N largest changes")
    compare.add_argument("--heatmap", metavar="PNG", help="also write a layer x head heatmap to this image file")
    compare.add_argument(
        "--heatmap-value",
        choices=("w1", "mean_shift", "median_shift"),
        default="w1",
        help="what the heatmap shows (default: w1; shifts use a diverging scale centred at 0)",
    )
    return parser


def _error(message: str) -> int:
    print(f"{PROGRAM}: error: {message}", file=sys.stderr)
    return 2


def _compare(args: argparse.Namespace) -> int:
    # Imported here so that `--help` and argument errors answer without loading torch.
    from attn_monitor.report.archive import load_summary
    from attn_monitor.report.comparison import compare

    try:
        summaries = [load_summary(path) for path in (args.a, args.b)]
    except FileNotFoundError as error:
        return _error(f"no such file: {error.filename!r}")
    except (OSError, ValueError) as error:
        return _error(str(error))
    try:
        comparison = compare(*summaries)
    except ValueError as error:
        return _error(f"{args.a!r} and {args.b!r}: {error}")
    # The heatmap first: a reader that stops early (`| head`) must not cost the image.
    if args.heatmap:
        try:
            comparison.heatmap(args.heatmap, value=args.heatmap_value)
        except (OSError, ValueError) as error:
            return _error(f"cannot write the heatmap {args.heatmap!r}: {error}")
    try:
        print(f"A: {args.a} ({int(summaries[0].count.sum())} counted queries)")
        print(f"B: {args.b} ({int(summaries[1].count.sum())} counted queries)")
        print(comparison.table(top=args.top))
        if args.heatmap:
            print(f"Heatmap ({args.heatmap_value}) written to {args.heatmap}")
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe; point stdout at devnull so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Args:
        argv: arguments after the program name.

    Returns:
        0 on success, 2 on bad arguments, unreadable or incomparable files.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad arguments (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        return _error("choose a command, e.g. `compare A B`")
    return _compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
