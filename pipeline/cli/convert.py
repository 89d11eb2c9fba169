"""``winnow convert`` and ``tools/convert_checkpoint.py``: the command line of ``pipeline.checkpoint.convert``.

Each direction is an ``add_*_arguments`` / ``run_*`` pair over the library function
(``hf_to_megatron`` / ``megatron_to_hf``), which returns a ``ConversionSummary``
printed on stdout. ``main`` is the standalone converter: a ``UserError`` prints one
``error:`` line on stderr and exits 2, as ``winnow`` does.
"""

from __future__ import annotations

import argparse
import re
from typing import Sequence

from pipeline.checkpoint.convert import EXPORT_DTYPES, hf_to_megatron, megatron_to_hf
from pipeline.checkpoint.gate import GATE_ATOL
from pipeline.cli.common import run_handler

__all__ = [
    "add_hf_to_megatron_arguments",
    "add_megatron_to_hf_arguments",
    "build_parser",
    "main",
    "parse_size",
    "run_hf_to_megatron",
    "run_megatron_to_hf",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` → bytes, with transformers' convention: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    number, unit = match.groups()
    num_bytes = int(float(number) * _SIZE_UNITS[(unit or "B").upper()])
    if num_bytes < 1:
        raise ValueError(f"invalid size {text!r}: must be at least one byte")
    return num_bytes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_gate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the logit verification gate (not recommended)")
    parser.add_argument("--atol", type=float, default=GATE_ATOL,
                        help=f"gate tolerance: max |logit diff| in fp32 (default {GATE_ATOL:g})")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only after the new output passed the gate)")


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="a run's checkpoint directory (uses 'latest') or one step_* directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="the HF folder to create")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer files to copy (default: a tokenizer/ folder in the step or run directory)")
    parser.add_argument("--step", type=int, metavar="N", help="export step_N of the run directory instead of 'latest'")
    parser.add_argument("--dtype", choices=["auto", *EXPORT_DTYPES], default="auto",
                        help="weights dtype (default auto: the source HF model's dtype if recorded, else fp32)")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                        help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    _add_gate_arguments(parser)


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    summary = megatron_to_hf(
        checkpoint=args.ckpt,
        out=args.out,
        tokenizer=args.tokenizer,
        step=args.step,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        verify=not args.no_verify,
        atol=args.atol,
        overwrite=args.overwrite,
    )
    print(summary.format())
    return 0


def megatron_to_hf_inputs(args: argparse.Namespace) -> object:
    """What `pipeline.stages.preflight` checks before the export loads anything."""
    from pipeline.stages.preflight import CheckpointInputs

    return CheckpointInputs(checkpoint=args.ckpt, out=args.out, tokenizer=args.tokenizer, step=args.step)


def hf_to_megatron_inputs(args: argparse.Namespace) -> object:
    from pipeline.stages.preflight import HfFolderInputs

    return HfFolderInputs(hf=args.hf, out=args.out)


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, metavar="DIR", help="a Hugging Face model folder (safetensors)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the run directory to create")
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="tensor-parallel size the RL run will use (recorded and verified)")
    parser.add_argument("--pp", type=_positive_int, default=1, metavar="M",
                        help="pipeline-parallel size the RL run will use (recorded and verified)")
    _add_gate_arguments(parser)


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    summary = hf_to_megatron(
        hf=args.hf,
        out=args.out,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        verify=not args.no_verify,
        atol=args.atol,
        overwrite=args.overwrite,
    )
    print(summary.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The standalone converter's parser (``tools/convert_checkpoint.py``); ``winnow convert`` has the same."""
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="Convert checkpoints between Hugging Face and winnow's megatron format, verified by logits.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, add_arguments, run, inputs in (
        ("hf-to-megatron", "HF folder -> winnow run directory (step_00000000, weights only)",
         add_hf_to_megatron_arguments, run_hf_to_megatron, hf_to_megatron_inputs),
        ("megatron-to-hf", "winnow checkpoint -> HF folder that transformers and SGLang load",
         add_megatron_to_hf_arguments, run_megatron_to_hf, megatron_to_hf_inputs),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(handler=run, inputs=inputs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one conversion; a ``UserError`` prints ``error: ...`` and returns 2, as ``winnow`` does."""
    return run_handler(build_parser().parse_args(argv))
