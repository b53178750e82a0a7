"""One rank's shipping: ``sender`` (the shell ``ship()`` talks to), its pure job ``ledger``,
the serving ``loop``, the WRITE ``writer``, the share ``hasher`` and its ``stats``."""
