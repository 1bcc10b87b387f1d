"""``python -m titan_core.cli COMMAND ...``: the ``titan`` console script without the script."""

import sys

from titan_core.cli import main

sys.exit(main())
