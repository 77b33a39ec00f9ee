"""``python -m spark_credit_shuffle``: the command line of :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
