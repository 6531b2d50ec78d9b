"""``python -m autopart ...``: the same as the ``autopart`` command."""
from autopart.cli import run

if __name__ == "__main__":
    run()
