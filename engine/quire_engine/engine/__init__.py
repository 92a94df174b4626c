"""The engine loop: ``LLMEngine`` (one step = schedule, run the model, sample, emit), the offline
``LLM`` API over it, the ``AsyncEngine`` thread that serves it to the HTTP side, the metrics
recorder and the step profiler.
"""
