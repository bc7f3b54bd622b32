import sys

from hybridrl.cli import main

sys.exit(main())
