import sys

from relpos_ablate.cli import main

sys.exit(main())
