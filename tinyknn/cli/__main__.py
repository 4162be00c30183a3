"""`python -m tinyknn.cli` runs the `tinyknn` command."""

import sys

from . import main

sys.exit(main())
