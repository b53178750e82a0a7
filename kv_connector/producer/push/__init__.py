"""Push delivery: each rank WRITEs every sample into the pool of the reader its request was
bound to (``mode``), and a request starts once every rank reaches that reader."""
