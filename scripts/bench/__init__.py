"""The benchmark (``make bench``: ``python -m scripts.bench``). Its arms, one module each:
``model`` (tiny-model prefill with extraction), ``datapath`` (the connector's worker side
against raw NIXL and vLLM's example connector), ``step`` (the connector's cost per engine
step), ``pull`` (the pull client's READs, speculators' DataLoader on it) and ``fp8``
(the reader CLI's fp8 files); outside ``make bench``: ``journal``, ``datagen`` and
``multinode``. ``paired`` runs two arms in alternating pairs; ``summary`` turns the arms'
results into the last line: figures, the ceilings this machine allows, the targets missed.
Each arm is also ``python -m scripts.bench.ARM``. Nothing here imports ``tests``."""
