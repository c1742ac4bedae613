"""``python -m comparator``: thin subcommands over the library, with the shared flag groups."""
