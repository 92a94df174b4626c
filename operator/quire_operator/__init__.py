"""Quire's Kubernetes operator: reconciles InferenceService objects (quire.dev/v1alpha1).

Layers, top to bottom (pyproject.toml's import contract: each imports only those below it):
- ``cli``: the ``quire-operator`` command: flags, API client, kopf run;
- ``handlers``: thin kopf handlers that all end in one (retried) reconcile; ``requeue``: retries
  with backoff and the periodic resync; ``peering``: whether this process is the active one;
  ``settings``: kopf settings;
- ``reconcile/``: one reconcile: parse once, build, apply under the ownership rules, observe,
  write the status;
- ``status/``: pure conditions from what the reconcile saw, one Event per transition, the
  operator's own metrics;
- ``observed/``: the observed Deployment, pods, pool, Job -> frozen views (the only reader of
  them), and the Prometheus reading of a service waking from zero;
- ``children``: read / server-side apply / delete of the owned kinds, and the API's errors;
- ``builders/``: pure builders: typed view -> the children's API JSON;
- ``spec/``: the custom object -> its typed view (the only reader of the spec);
- ``kinds``: the table of the kinds it touches (group, version, plural, optional CRD, watch rule,
  RBAC); ``meta``: its identity to the API server, labels and owner references; ``config``:
  operator-wide settings set by its flags.
"""
