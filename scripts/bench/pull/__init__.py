"""Pull delivery, measured in pairs (``scripts.bench.paired``: alternating A/B rounds after a
warm-up pair, the median ratio with its min and max):

``pull_read_over_raw``: our ``PullClient`` fetching samples by their handles (several in
flight, ``fetch_iter``: the control round trips, the producer's XXH3 and the client's
check of it, the values check, each sample taken and let go) over a raw NIXL READ of the
same block spans between the same two processes (no protocol, no checks), in GB/s. The
producer is a ``PullServer`` over a cache tensor (no vLLM) at GPU-like shape: 4 captured
layers x hidden 4096 bf16, GPU block layout (TLH), block 128, 2048-token samples (64 MiB
each) in scattered blocks, held again every round; the consumer does both arms, the raw
one into a registered buffer of the client's pool size, ``IN_FLIGHT`` READs at a time.
During the raw arm the producer's own progress thread polls as it does while a consumer
reads (this NIXL runs without a progress thread). Each arm also reports the CPU seconds
per GB of both processes (their rusage over the round), and the milliseconds per sample of
the client's checks measured in the consumer. ``read_unchecked`` is the same pairing with
the checks off at both ends (producer ``checksum=False``, client ``check_values=False``):
what the protocol itself costs over the raw READ.

``checked_raw_over_raw``: the same raw READs with the client's checks (XXH3 and the values
check of each sample on a thread of its own as its READ completes) while the producer
hashes its samples in the background, as the server does, over the plain raw READs: the
least any design with those checks pays on this machine (no protocol), the ceiling of
``pull_read_over_raw``.

``pull_over_file``: rows/s through speculators' own DataLoader
(``create_train_val_loaders(..., on_missing="generate", num_workers=12)``, speculators'
default) with our ``kv-hidden-states`` backend (the rank's fetch agent, its default)
against a vLLM OpenAI server in pull delivery, over the same
with speculators' ``file`` backend against an identical server whose connector is vLLM's
ExampleHiddenStatesConnector made CPU-safe (``scripts.support.cpu_example_connector``), writing
its safetensors files to a temporary directory on local disk (``tempfile``'s default,
/tmp). Both servers run the same flags: a Llama of hidden 4096 whose compute is tiny (1
attention head of dim 64, intermediate size 64, 4 layers, vocabulary 1024, random
weights: ``--load-format dummy``), bf16, 4 captured layers (1, 2, 3 and the last, 4),
``ROW_TOKENS``-token rows (16 MiB each), block 128. A round is one epoch of ``ROWS`` rows.
Two loaders (one trainer rank each) are alive at a time.

``rank_agent_over_worker_clients``: the same DataLoader on the same pull server, the
rank's one fetch agent (``--kv-hs-fetch-agent rank``) over a client per worker
(``worker``), rows/s; and for each, what fetches for the rank (``Loader.consumers``): the
processes that made a NIXL agent (``scripts.support.proc_tree``), the consumer agents the
producer logged serving the rank's processes with the pool each registered, and the
rank's processes' memory (PSS). The profile says where
a row's time goes: the server's request time (queue, prefill) from its /metrics, and the
DataLoader workers' time in the transfer's ``get_generated`` and ``delete``
(``transfer`` times the backend's transfer).

``manifest_only_over_file``: the same DataLoader with the pull backend less its data
(``transfer.ManifestOnly``: the row's manifest asked for, the sample
released, a constant tensor of its shape returned; nothing READ, copied or checked) over
the file backend: speculators' own work per row and the server's, around a transfer that
costs nothing, the ceiling of ``pull_over_file`` on this machine.

The modules: ``read`` (the READ pairings; its two processes in ``read_producer`` and
``read_consumer``, spoken to over pipes through ``child``), ``loader`` (the DataLoader
pairings; the DataLoader process is ``loader_proc``, its workers' timing ``transfer``, the
two vLLM servers ``servers``), ``shape`` (the sizes both share) and ``run`` (all of them, as
``make bench`` runs them).

``python -m scripts.bench.pull`` prints progress to stderr and the result JSON as its
last stdout line (``--loader``: the DataLoader pairings only; ``--read``: the READ
pairings only). Every process it starts is stopped before it returns.
"""
