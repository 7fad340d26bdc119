import sys

from gdn_backport.cli import main

sys.exit(main())
