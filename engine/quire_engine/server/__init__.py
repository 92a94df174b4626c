"""The HTTP edge: the FastAPI app (``app``) and its endpoints (``endpoints``), a submitted
request's way out (``job``), OpenAI-shaped errors (``errors``, ``openapi``), the
``quire-engine serve`` command (``cli``), the OpenAI wire protocol (``protocol``), response
rendering, middleware, prompt encoding and the graceful drain.

It talks to the engine only through ``quire_engine.engine`` (``AsyncEngine``, ``LLMEngine``)
and never reaches into the model layer's internals.
"""
