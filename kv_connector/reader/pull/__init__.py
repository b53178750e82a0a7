"""Pull delivery's consumer: ``PullClient`` READs a sample from its producer's cache by
its handle, checks it against the hold's fences and hands it out from its own pool."""
