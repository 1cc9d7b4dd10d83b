#!/usr/bin/env bash
# Mutation testing (cosmic-ray) of the modules where a silent error costs most; see tools/mutation.py.
# Not part of CI: it runs the targets' tests once per mutant (hours for every target on 2 cores).
#   bash tools/mutation.sh --list | [TARGET...]
# cosmic-ray is a tool of this script, not a dependency of vgraph: installed into .venv on first use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
if [ ! -x "$PY" ]; then
    echo "mutation.sh: $ROOT/.venv is missing; run 'bash tools/test.sh' once to create it" >&2
    exit 2
fi
if [ ! -x "$ROOT/.venv/bin/cosmic-ray" ]; then
    echo "mutation.sh: installing cosmic-ray into .venv" >&2
    flock /tmp/vgraph-pip.lock "$PY" -m pip install -q "cosmic-ray>=8.3"
fi
exec nice -n "${VGRAPH_MUTATION_NICE:-15}" "$PY" "$ROOT/tools/mutation.py" "$@"
