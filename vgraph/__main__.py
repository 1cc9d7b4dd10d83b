import sys

from vgraph.cli.main import main

sys.exit(main())
