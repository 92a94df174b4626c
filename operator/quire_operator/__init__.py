"""Quire's Kubernetes operator: reconciles InferenceService objects (quire.dev/v1alpha1).

Modules, in the order data flows:
- ``spec``: the custom object -> frozen dataclasses (the only reader of the spec);
- ``deployment``, ``objects``: pure builders of the Deployment, Service, HPA and PDB;
- ``reconcile``: server-side apply of those with one field manager, then the status;
- ``status``: pure conditions from what the reconcile saw;
- ``handlers``: thin kopf handlers that all end in one reconcile;
- ``settings``, ``cli``: kopf settings and the ``quire-operator`` command.
"""
