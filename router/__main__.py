"""`python -m pagoda.router`: run one router process (flags in router/args.py)."""
from pagoda.router.server import main
from pagoda.runtime.serving import exit_now

if __name__ == "__main__":
    exit_now(main())
