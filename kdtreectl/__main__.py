"""`python -m kdtreectl`: the same as the kdtreectl command."""

import sys

from .cli import main

sys.exit(main())
