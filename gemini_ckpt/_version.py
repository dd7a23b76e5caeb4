"""The package version (one place; the facade and the job description import it)."""

__version__ = "0.1.0"
