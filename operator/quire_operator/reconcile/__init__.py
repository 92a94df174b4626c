"""One reconcile of one InferenceService:
- ``reconciler``: the entry point: read, parse once, converge, observe, write the status;
- ``converge``: apply and delete the children under the ownership rules;
- ``observe``: our children, their pods and Prometheus -> the status's ``Observation``.
"""
