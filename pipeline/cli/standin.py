"""``python -m pipeline.cli.standin``: the CPU stand-in for ``sglang.launch_server`` (``pipeline.rollout.standin``).

It takes SGLang's command line as the ``serve`` role writes it; flags that tune GPU kernels
are accepted and ignored (and named once on start).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.rollout.standin import DEFAULT_WEIGHT_VERSION, LISTEN_BACKLOG, REQUEST_LOG_ENV, serve_standin


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m pipeline.cli.standin",
                                     description="a CPU stand-in for sglang.launch_server (campaign rehearsals)")
    parser.add_argument("--model-path", required=True, help="the Hugging Face folder to serve")
    parser.add_argument("--tokenizer-path", default=None, help="accepted for SGLang compatibility (ids only)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1, help="must be 1: the stand-in plays one rank")
    parser.add_argument("--base-gpu-id", type=int, default=0, help="accepted for SGLang compatibility")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="SGLang's limit on requests run at once; the stand-in runs one at a time and "
                             "keeps this many waiting connections (the client opens no more)")
    parser.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION)
    parser.add_argument("--request-log", default=os.environ.get(REQUEST_LOG_ENV),
                        help=f"append one JSON line per generate/update request (default: ${REQUEST_LOG_ENV})")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, ignored = parse_args(argv)
    if args.tp_size != 1:
        print(f"error: --tp-size {args.tp_size}: the stand-in is one process and plays one rank of an update "
              "group (rehearse SGLang TP servers as --tp-size 1)", file=sys.stderr)
        return 2
    if args.max_running_requests is not None and args.max_running_requests < 1:
        print(f"error: --max-running-requests {args.max_running_requests}: must be >= 1", file=sys.stderr)
        return 2
    if not (Path(args.model_path) / "config.json").is_file():
        print(f"error: --model-path {args.model_path} holds no config.json", file=sys.stderr)
        return 2
    if ignored:
        print(f"stand-in server: ignoring SGLang flags {' '.join(ignored)}", flush=True)
    serve_standin(model_path=args.model_path, host=args.host, port=args.port,
                  weight_version=args.weight_version, request_log=args.request_log,
                  listen_backlog=max(LISTEN_BACKLOG, args.max_running_requests or 0),
                  out=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
