"""What the operator reports about an InferenceService:
- ``conditions``: pure: what a reconcile saw -> its ``status``;
- ``events``: one Kubernetes Event per status transition;
- ``metrics``: the operator's own Prometheus metrics (Events and wake-ups per InferenceService).
"""
