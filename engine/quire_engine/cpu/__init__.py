"""The native CPU backend: C kernels (``csrc/``) compiled on first use, their ctypes loader
(``native``), the CPU attention planner (``paged_attention``), the whole-step CPU decoder
(``decoder``) and the routing of small-batch ``nn.Linear`` calls (``linear``).

It imports the Triton package's torch references (``quire_engine.kernels``) and nothing from the
core, model, engine or server layers.
"""
