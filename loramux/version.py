"""The package version (pyproject.toml gives the same to the distribution)."""

__version__ = "0.1.0"
