"""The broker's benchmark suite: ``python -m benchmarks`` measures one broker against its targets.

It starts a private Redis and a broker process of its own, drives them over real sockets from
separate processes, and prints (and writes as JSON) every figure with its target and the raw-Redis
ceiling it is bounded by. See ``benchmarks/README.md``.
"""
