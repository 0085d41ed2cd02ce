"""Benchmarks of the bounded KV cache against the full cache: ``python -m h2o_chat.bench``.

Modules: ``data`` (passages from shared/data), ``metrics`` (perplexity, top-1 agreement,
KL), ``variants`` (policy variants for the tuning study and a policy that runs several
policies side by side in one batch), ``streaming`` (comparisons 1 and 2 and the tuning
study), ``xsum`` (3), ``speed`` (4), ``long_chat`` (5), ``report`` (JSON, markdown, PNG); the GPU
check: ``gpu`` (what it measures), ``gpu_checks`` (correctness on the device),
``gpu_models`` (random-weight Llamas of real shapes), ``gpu_loading`` (the loader's branches);
``client`` (a running server seen from outside: its metrics, a request on a socket of its own).
"""
