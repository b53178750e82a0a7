import sys

from kv_connector.datagen.driver import main

sys.exit(main())
