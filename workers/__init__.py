"""Worker side: the inference engine, the KV pool client and the worker servers."""
