"""What the benchmark, the demo, the GPU check and the tests share: vLLM's server and worker
harnesses, network namespaces, tiny models, process trees. Nothing here imports ``tests``."""
