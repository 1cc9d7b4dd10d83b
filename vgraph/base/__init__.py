"""The foundation every layer stands on: diagnostics (a user's mistake as data, never a traceback), bounded
reads and atomic writes (`safeio`), checked command-line values (`options`), terminal-safe output, and the
garbage-collector pause used around bulk graph building.  Imports nothing else from vgraph."""
