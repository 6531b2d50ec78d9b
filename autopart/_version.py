"""autopart's version, in a module of its own: the compiler's digest and the checkpoint's
metadata read it at import time without importing the package's front (autopart/__init__.py,
which imports the compiler, the front door and the runtime)."""
__version__ = "0.1.0"       # pyproject.toml's [project] version
