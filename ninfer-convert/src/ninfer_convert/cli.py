"""The ``ninfer-convert`` command.

``ninfer-convert SRC OUT [--name NAME] [--max-file-bytes N] [--quantize RECIPE] [--draft DRAFT_DIR] [--quiet]``
converts a Hugging Face checkpoint folder (with ``--draft``, plus a separately published speculative drafter for it,
stored as one more component) into a V3 artifact; ``ninfer-convert verify FILE`` re-reads and checks every
object of an artifact. ``verify`` is recognised only as the first argument (a source folder
literally named ``verify`` is given as ``./verify``). Exit status: 0 success, 1 a NInfer error
(the message names what is at fault), 2 bad usage, 130 interrupted, 143 terminated (SIGTERM); either
way a conversion in progress publishes nothing and leaves no temporary file.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from ninfer.errors import NInferError

PROG = "ninfer-convert"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that a conversion in progress cleans up as on Ctrl-C."""


def _on_sigterm(_signum, _frame) -> None:
    raise _Terminated


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _convert_parser() -> argparse.ArgumentParser:
    # Imported here: it imports torch, which takes a moment, and a Ctrl-C then must meet main's handling.
    from ninfer.artifact.format import DEFAULT_MAX_FILE_BYTES

    p = argparse.ArgumentParser(
        prog=PROG, description="Convert a local Hugging Face checkpoint folder into a V3 .ninfer artifact. "
                               f"Use '{PROG} verify FILE' to check an artifact's checksums.")
    p.add_argument("source", metavar="SRC", help="checkpoint folder (config.json + *.safetensors)")
    p.add_argument("output", metavar="OUT", help="artifact entry file to create (never overwritten)")
    p.add_argument("--name", help="public model name stored as metadata.name (default: the source folder's name)")
    p.add_argument("--max-file-bytes", type=_positive_int, default=DEFAULT_MAX_FILE_BYTES, metavar="N",
                   help=f"largest file of the set in bytes; more payload goes to OUT.part-NNNN files "
                        f"(default {DEFAULT_MAX_FILE_BYTES})")
    p.add_argument("--quantize", metavar="RECIPE",
                   help="store matmul weights quantized: a preset (fp8, q8, q6, q5, q4, mixed; +search: scale search; +a8 last: "
                        "8-bit activations for the fp8 dense projections) or a TOML recipe "
                        "file (docs/converter.md)")
    p.add_argument("--draft", metavar="DRAFT_DIR",
                   help="a drafter checkpoint folder for SRC (a DFlash or DFlash2 drafter in the z-lab format), added "
                        "as the artifact's 'dflash' component (docs/speculative.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} verify",
                                description="Re-read every object of an artifact and check its checksum.")
    p.add_argument("file", metavar="FILE", help="artifact entry file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _run_convert(argv: Sequence[str]) -> int:
    args = _convert_parser().parse_args(argv)
    from ninfer.conversion import convert  # heavy imports only once the arguments parse

    result = convert(args.source, args.output, name=args.name, max_file_bytes=args.max_file_bytes,
                     progress=False if args.quiet else None, quantize=args.quantize, draft=args.draft)
    print(f"wrote {result.paths[0]}: {result.objects} tensor objects ({result.tensor_bytes} bytes), "
          f"{len(result.resources)} resources, {len(result.paths)} file(s); architecture "
          f"{result.architecture}, source mapping {result.source_mapping}")
    for extra in result.paths[1:]:
        print(f"  part {extra}")
    if result.quantized:
        counts: dict[str, int] = {}
        for fmt in result.quantized.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        print("  quantized objects: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items())))
    if result.casts:
        print(f"  cast objects: {', '.join(result.casts)}")
    if result.ignored:
        print(f"  ignored source tensors: {len(result.ignored)}")
    if "resource/text/tokenizer.json" not in result.resources:
        print(f"{PROG}: warning: {args.source} has no tokenizer.json: the artifact holds no tokenizer, so no "
              f"engine can start on it (generate, chat, serve and score need one)", file=sys.stderr)
    return 0


def _run_verify(argv: Sequence[str]) -> int:
    args = _verify_parser().parse_args(argv)
    from ninfer_convert.verify import verify_artifact

    report = verify_artifact(args.file, progress=False if args.quiet else None)
    print(f"{report.path}: {report.objects} objects ({report.tensors} tensors, {report.resources} resources), "
          f"{report.bytes} bytes in {report.files} file(s): OK")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ninfer-convert`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:   # not the main thread (called from a program): leave SIGTERM alone
        previous = None
    try:
        if argv and argv[0] == "verify":
            return _run_verify(argv[1:])
        return _run_convert(argv)
    except NInferError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, _Terminated) else "interrupted"
        print(f"{PROG}: {what} (a conversion in progress publishes nothing)", file=sys.stderr)
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
