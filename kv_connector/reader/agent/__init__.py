"""A trainer rank's fetch agent: one process holding the rank's ``PullClient``, and the
``AgentClient`` its DataLoader workers fetch through over a Unix socket."""
