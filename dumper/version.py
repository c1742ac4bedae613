"""The driftscope version: one string, importable from the core without loading a package root."""

__version__ = "0.1.0"
