"""``python -m dtrain ...`` is the ``dtrain`` command."""

import sys

from dtrain.cli import main

sys.exit(main())
