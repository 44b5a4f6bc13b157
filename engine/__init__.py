"""One instance's engine: models, unmasking rules, KV caches, runners, the offline batched engine."""
