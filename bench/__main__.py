"""``python -m bench`` (``make bench``): see bench/run.py."""

from .run import main

if __name__ == "__main__":
    main()
