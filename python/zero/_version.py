"""The package's version, in one place (pyproject.toml's is the distribution's)."""
__version__ = "0.1.0"
