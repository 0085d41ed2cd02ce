"""The KV-cache engine: a bounded cache for stock transformers models.

``policies`` (which slots to keep), ``rope`` (moving keys to other positions),
``slots`` (stacked buffers and the eviction kernel), ``cache`` (the transformers-facing
layer and cache), ``state`` (save/resume), ``attention`` (the registered attention
function that feeds the layers their scores) and ``build`` (``make_cache``). The engine
depends on torch, transformers and ``h2o_chat.config`` only.
"""
