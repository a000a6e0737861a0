"""``python -m wushkv.cli``: the ``wushkv`` command."""

import sys

from . import main

sys.exit(main())
