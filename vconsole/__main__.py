"""``python -m vconsole ...`` is ``vconsole ...`` (so ``torchrun -m vconsole engine`` works)."""

import sys

from vconsole.cli import main

sys.exit(main())
