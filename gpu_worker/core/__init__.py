"""The engine core: requests, the block pool and its host tier, the KV-cache manager, the
scheduler, the typed objects between layers, sampling parameters, the stop rule, detokenization.

No torch model code here; nothing in core imports the runner, the models or the features.
"""
