"""Benchmarks that measure ours against baselines in the same run: the similarity join and
top-k search and the whole pass (``consolidate-bench``, :mod:`.benchmark`), the store
formats (:mod:`.store_bench`), the fleet pass on Ray (:mod:`.fleet_bench`), MinHash
(:mod:`.minhash_bench`) and embedding (:mod:`.embed_bench`); the others run as
``python -m consolidate.bench.NAME``."""
