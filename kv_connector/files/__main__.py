import sys

from kv_connector.files.cli import main

sys.exit(main())
