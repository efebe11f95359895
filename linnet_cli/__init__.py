"""Linnet command line: a thin Typer app over linnet_core."""
