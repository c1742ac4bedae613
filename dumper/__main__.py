import sys

from dumper.cli.main import main

sys.exit(main())
