"""`python -m moesim` runs the CLI."""

from moesim.cli import entry

entry()
