"""``python -m gdn_backport.engine_suite``."""

import sys

from gdn_backport.engine_suite.cli import main

sys.exit(main())
