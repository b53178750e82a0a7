"""Pull delivery: each rank holds every sample in vLLM's cache (``mode``) and serves it from
its own endpoint (``server``) until a consumer releases it; ``ledger`` keeps the holds,
``hold_states`` their transitions, ``hold_fences`` the words a consumer checks after a READ."""
