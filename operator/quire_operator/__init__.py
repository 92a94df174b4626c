"""Quire's Kubernetes operator: reconciles InferenceService objects (built in a later issue)."""
