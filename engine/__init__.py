"""One instance, bottom up: the models (``models/``), unmasking rules (``decoding``), sequences and their
KV caches (``sequence``, ``kv_cache``), the torch runner and its CUDA graphs (``runner``, ``batch``,
``graphs``), the engine that runs one round (``engine``), the instance scheduler (``scheduler/``), the
instance that joins them (``instance``), and the round loop in its thread (``loop``, with its progress
records, ``progress``, and failed-round probing, ``probing``). Beside them: model loading, tokenizers,
latency profiles and their measurement, clocks, registries. Nothing here imports another package of
Remask's."""
