import sys

from kv_connector.reader.cli import main

sys.exit(main())
