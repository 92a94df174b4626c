"""Kubernetes quantities as the metrics APIs return them ("6", "6500m", "1k") -> float."""

from __future__ import annotations

_SUFFIXES = {
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
}


def parse_quantity(text: str) -> float:
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(text)
