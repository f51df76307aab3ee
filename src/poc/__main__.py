"""python -m poc: see poc.cli."""

import sys

from poc.cli import main

sys.exit(main())
