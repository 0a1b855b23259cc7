"""`python -m arborspec.server ARGS` runs `arborspec serve ARGS`."""
import sys

from .run import main

sys.exit(main())
