"""The model side: loading checkpoints, the runner that turns a scheduler plan into tensors and
runs the forward, the attention transformers calls into, the sampler and the embedded tiny model.

The only layer that holds tensors of the model and the KV pool; it executes the core's plans
through ``kernels`` (CUDA) and ``cpu`` (the native CPU backend).
"""
