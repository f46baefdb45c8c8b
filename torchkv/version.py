"""The package version, one definition below every layer (the facade and the result files read it)."""

__version__ = "0.1.0"
