"""Pure builders: the typed view of an InferenceService -> its children's API JSON (or None
where the spec wants none). Nothing here calls the API server.
- ``desired``: every child one InferenceService wants, in apply order (from the modules below);
- ``deployment``: the engine's Deployment, its pod template and the engine's flags;
- ``leader_worker_set``: a multi-node replica's LeaderWorkerSet, leader and workers;
- ``service``: the engine's Service;
- ``hpa``: the HorizontalPodAutoscaler (backend hpa) and its metric names;
- ``autoscaling``: the KEDA ScaledObject (backend keda) and the choice between the two;
- ``disruption_budget``: the PodDisruptionBudget;
- ``inference_pool``: the InferencePool (routing);
- ``endpoint_picker``: the Endpoint Picker's Deployment, Service, RBAC and config (routing);
- ``model_cache``: the model cache's claim and download Job.
"""
