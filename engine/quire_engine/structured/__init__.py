"""Structured outputs: grammars compiled for the model's tokenizer (``grammars``) and the
per-sample matchers that mask each step's logits (``matchers``), with xgrammar as the backend.

A layer between the engine and the model: the engine creates matchers and asks them for a
token bitmask per step; the sampler (``model/sampler``) only applies a bitmask tensor and never
imports xgrammar; the server compiles grammars through the engine's cache before submitting,
so a bad schema is a 400 and compilation never runs on the step loop."""
