"""kopf settings for the Quire operator; each departure from kopf's default says why."""

from __future__ import annotations

import kopf

from quire_operator import meta


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping goes to annotations under our own prefix, never to status: the CRD's
    # structural schema prunes unknown status fields, so status.kopf would vanish on every write
    # and kopf would re-run finished handlers. Status belongs to the InferenceService's API.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=meta.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=meta.GROUP, key="last-handled-configuration"
    )
    # Watches that end server-side every few minutes and a client timeout above that: a watch
    # connection silently dropped by a load balancer is noticed and reopened, not waited on.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 30
    # The handlers' API calls are short; a hung request must not hold a reconcile for 5 minutes.
    settings.networking.request_timeout = 60
    # No cluster scans: the namespaces are named on the command line (no patterns) and the
    # resources are fixed when the operator starts (cli.py checks the CRD is served; the chart
    # installs CRDs first). Scanning would need cluster-wide list/watch of namespaces and CRDs,
    # which a namespaced install must not have; refused, kopf holds the watches back for a minute.
    settings.scanning.disabled = True
    return settings
