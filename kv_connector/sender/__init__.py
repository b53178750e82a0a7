"""One rank's shipping: ``sender`` (the shell ``ship()`` talks to), its pure job ``ledger``,
the serving ``loop``, the WRITE ``writer`` and its ``stats``; what it reads from the cache
and how it hashes it are ``kv_connector.cache``'s."""
