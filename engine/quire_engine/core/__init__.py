"""The engine's pure-Python core: configs, sequences, the block pool, the KV cache manager, the
scheduler, the request table, sampling parameters and outputs.

Nothing here imports torch or any layer above it (``model``, ``engine``, ``server``, ``bench``);
the import contracts in ``pyproject.toml`` enforce it. The core decides; the model layer
executes what it decided.
"""
