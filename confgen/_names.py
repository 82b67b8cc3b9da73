"""Names the renders give Kubernetes objects, shared with the checks that must predict them
(`confgen._checks` names the ADS control plane the kubernetes render creates). Imports
nothing of confgen, so the checks take it without a cycle."""

from __future__ import annotations

import hashlib
import re

__all__ = ["dns_label"]


def dns_label(text: str, limit: int = 63) -> str:
    """`text` as an RFC 1123 label starting with a letter (valid for every object kind,
    Services included): lowercased, anything but [a-z0-9-] mapped to '-', and cut to `limit`
    with a short hash of the original when too long (so two long names stay apart)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if not slug[0].isalpha():
        slug = "x-" + slug
    if len(slug) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        slug = slug[: limit - 9].rstrip("-") + "-" + digest
    return slug
