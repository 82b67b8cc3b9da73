"""Where each rendered Envoy file lives, in one place (the sidecar uses it too).

    bootstrap.json          node, admin, and where LDS/CDS come from
    lds.json                listeners (one file, watched through its directory)
    cds.json                clusters
    eds/<pool>/endpoints.json   one ClusterLoadAssignment per pool, each in its own directory

A rename in a watched directory reloads every subscription watching that directory, so
each EDS file has a directory of its own: the sidecar replacing one pool's endpoints
reloads that pool only.
"""

from __future__ import annotations

from pathlib import PurePosixPath

BOOTSTRAP = "bootstrap.json"
LDS = "lds.json"
CDS = "cds.json"
EDS_DIR = "eds"
EDS_FILE = "endpoints.json"


def eds_path(cluster: str) -> str:
    """Path of a cluster's EDS file, relative to the config directory."""
    return str(PurePosixPath(EDS_DIR, cluster, EDS_FILE))


def write_rank(path: str) -> int:
    """The order files are replaced in a live directory: EDS, then the clusters naming it,
    then the listeners whose routes name the clusters, then the rest (removals in reverse)."""
    if path.startswith(f"{EDS_DIR}/"):
        return 0
    return {CDS: 1, LDS: 2}.get(path, 3)


def failover_cluster(pool: str) -> str:
    """Name of the aggregate cluster that tries a pool, then its fallbacks.

    '.' cannot occur in a pool name, so this never collides with a pool's cluster.
    """
    return f"{pool}.failover"
