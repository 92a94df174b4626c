"""Quire's Kubernetes operator: reconciles InferenceService objects (quire.dev/v1alpha1).

Modules, in the order data flows:
- ``spec``: the custom object -> frozen dataclasses (the only reader of the spec);
- ``deployment``, ``objects``: pure builders of the Deployment, Service, HPA and PDB;
- ``children``: read / server-side apply / delete of those kinds;
- ``reconcile``: ownership check, apply with one field manager, then the status;
- ``observed``: the observed Deployment and pods -> frozen views (the only reader of them);
- ``status``: pure conditions from what the reconcile saw;
- ``events``: one Kubernetes Event per status transition;
- ``requeue``: retries with backoff and the periodic resync; ``peering``: who is active;
- ``handlers``: thin kopf handlers that all end in one (retried) reconcile;
- ``settings``, ``cli``: kopf settings and the ``quire-operator`` command.
"""
