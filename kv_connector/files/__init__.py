"""The reader CLI that writes samples to files exactly once (``python -m kv_connector.files``,
also ``python -m kv_connector.reader``): its file naming and layouts, the delivery journal,
safetensors I/O, the console and its progress line."""
