"""The `vgraph` command line, the top layer: the dispatcher (`main`) and the work of the listing commands.
Backends add their commands through the `vgraph.commands` entry point group."""
from vgraph.cli.main import EXIT_INVALID, add_plugin_option, main, run_commands

__all__ = ["EXIT_INVALID", "add_plugin_option", "main", "run_commands"]
