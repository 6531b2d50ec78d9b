"""``python -m autopart ...``: the same as the ``autopart`` command."""
import sys

from autopart.cli import main

if __name__ == "__main__":
    sys.exit(main())
