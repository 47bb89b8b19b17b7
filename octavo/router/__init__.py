"""Data parallelism: a prefix-aware router in front of N `octavo serve` replicas.

    client -> router (app.py, proxy.py) -> replica 1..N (`octavo serve`, each its own engine)

For each request the router computes the prompt's token ids as the replicas will
(prompts.py: the same tokenizer and chat template) and their full-block hashes with the
engine's own `BlockHasher`, so its per-replica index of the blocks it sent
(prefix_index.py: bounded, LRU) names the very blocks the replicas' prefix caches hold. The
policy (policy.py) sends a request to the replica with the longest run of matching leading
blocks unless that replica is too loaded (SGLang's balance thresholds). replicas.py
health-checks the replicas; metrics.py exports per-replica Prometheus metrics;
data_parallel.py is `octavo serve --data-parallel-size N`.

Nothing is imported here: `octavo.cli` imports `octavo.router.args` for every command.
"""
