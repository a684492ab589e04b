"""The package's version, in a module of its own so that any layer can read it without importing
the `pagoda` package facade (which pulls in nothing heavy, but is the top of the import graph).
Keep it equal to `version` in pyproject.toml."""

__version__ = "0.1.0"
