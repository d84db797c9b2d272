"""`python -m router`: run one router process (flags in router/args.py)."""
from router.server import main

if __name__ == "__main__":
    main()
