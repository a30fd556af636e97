"""``python -m spinwheel ...`` (and so ``torchrun -m spinwheel ...``) is the ``spinwheel`` command."""

import sys

from spinwheel.cli import main

sys.exit(main())
