"""``python -m quire_operator``: the same as the ``quire-operator`` console script."""

import sys

from quire_operator.cli import main

sys.exit(main())
