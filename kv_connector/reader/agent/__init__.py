"""A trainer rank's fetch agent: one process holding the rank's ``PullClient``, and its client.

The rank's DataLoader workers fetch through ``AgentClient``, over a Unix socket."""

