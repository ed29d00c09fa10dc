import sys

from kvforge.cli import main

sys.exit(main())
