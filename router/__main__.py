"""`python -m router`: run one router process (flags in router/args.py)."""
from protos.serving import exit_now
from router.server import main

if __name__ == "__main__":
    exit_now(main())
