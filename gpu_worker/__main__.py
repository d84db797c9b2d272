"""`python -m pagoda.gpu_worker --model DIR ...`: one worker process (flags in gpu_worker/serving/args.py)."""
import asyncio
import logging
import os
import sys

from pagoda.gpu_worker.serving.args import build_parser
from pagoda.runtime.lifetime import die_with_parent
from pagoda.runtime.serving import StartupError, exit_now


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    die_with_parent()
    if os.path.isdir(args.model) and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model: {args.model!r} is not a checkpoint directory (no config.json)")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # lazy: torch and the engine load only once the flags are good (--help and flag errors stay quick)
    from pagoda.gpu_worker.serving.server import serve
    try:
        return asyncio.run(serve(args))
    except StartupError as e:   # a taken port, a missing certificate: one line saying what to change
        print(f"pagoda worker: {e}", file=sys.stderr, flush=True)
        return 2
    except ValueError as e:     # a bad flag value or model found by the engine: say which, no traceback
        logging.getLogger("gpu_worker").error("%s", e)
        return 2


if __name__ == "__main__":
    exit_now(main())
