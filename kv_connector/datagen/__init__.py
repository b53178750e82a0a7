"""The data-generation driver: every row of a dataset through a producer vLLM, so that its
hidden states stream to the reader (``python -m kv_connector.datagen``); ``plan`` holds
its pure bookkeeping, ``driver`` the requests, threads and reports."""
