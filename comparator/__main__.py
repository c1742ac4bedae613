import sys

from comparator.cli.main import main

sys.exit(main())
