"""One router process: mirrors the workers' cached blocks and load from Redis, scores workers
per request and proxies the Generate stream to the best one, with failover.

Imports no torch and no gpu_worker: a router image needs no GPU stack.
"""
