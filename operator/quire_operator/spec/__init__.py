"""The InferenceService's spec, read once per reconcile:
- ``view``: the typed view (frozen dataclasses), its ``Identity`` and ``InvalidSpec``;
- ``parsing``: the custom object -> that view (the only reader of the custom object).
"""
