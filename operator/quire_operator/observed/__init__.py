"""What the operator observes, read once per reconcile:
- ``views``: API JSON of Deployments, LeaderWorkerSets, pods, pools, autoscalers and Jobs ->
  frozen views (the only reader of them);
- ``prometheus``: one instant query (the requests held while a service wakes from zero).
"""
