"""Tests of quire_engine.server: the OpenAI-compatible API, the serve CLI, parsers and shutdown."""
