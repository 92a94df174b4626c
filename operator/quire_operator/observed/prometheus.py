"""One number from Prometheus: an instant query over its HTTP API.

The reconciler reads the Endpoint Picker's held-request gauge through the same Prometheus the
ScaledObject's triggers query, only while an InferenceService wakes from zero, to say how many
requests wait for the replica that is starting. A failed or empty answer is ``None``: the status
then says that requests are held without a count; nothing else depends on it.

Stdlib only (``urllib``); no state.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.parse
import urllib.request

logger = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # a reconcile must not wait on a slow Prometheus


def instant_value(address: str, query: str, timeout: float = TIMEOUT_S) -> float | None:
    """The value of a query that yields one sample (e.g. a ``sum``); None when Prometheus cannot
    be reached, refuses the query or returns no sample."""
    url = f"{address.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            answer = json.load(reply)
        result = answer["data"]["result"]
        value = float(result[0]["value"][1]) if len(result) == 1 else None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        logger.debug("Prometheus query %r failed: %s", query, err)
        return None
    return value if value is not None and math.isfinite(value) else None
