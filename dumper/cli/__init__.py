"""``python -m dumper``: thin argument parsing over :mod:`dumper.jobs` and :mod:`dumper.format`."""
