"""How the producer reads a sample out of vLLM's cache and takes its integrity record,
below both delivery modes: push ships what it reads, pull serves it."""
