"""Names the renders give Kubernetes objects, shared with the checks that must predict them
(`confgen._checks` names the ADS control plane the kubernetes render creates). Imports
nothing of confgen, so the checks take it without a cycle."""

from __future__ import annotations

import hashlib
import re

__all__ = ["BASE_LIMIT", "dns_label", "object_base"]


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


# The longest suffix a render puts after the base (`-epp-topology`, 13) and the StatefulSet `<base>-xds`, whose pods
# carry a `controller-revision-hash` label of its name + 11 characters: a base of at most 48 keeps every Service,
# pod hostname and label value within a DNS label's 63.
BASE_LIMIT = 48


def object_base(topology_name: str) -> str:
    """The prefix of every Kubernetes object a render names for the topology (`confgen-<name>`, cut to
    BASE_LIMIT with a hash when longer)."""
    return dns_label(f"confgen-{topology_name}", BASE_LIMIT)
