"""The version string, in a module of its own so that lower layers (jit/) can read it without importing
the package face (tinyknn/__init__.py). pyproject.toml reads it from here too: one source."""

__version__ = "0.1.0"
