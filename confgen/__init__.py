"""confgen: one topology file for a fleet of LLM inference servers -> proxy configuration.

Public API: `load_topology`, `parse_topology`, the `Topology` model, the renderers
(`confgen.envoy.render`, `confgen.nginx.render`) and the error hierarchy.
"""

from .errors import (
    ConfgenError,
    Diagnostic,
    OutputError,
    ProxyError,
    SecretError,
    Severity,
    TopologyError,
    VerifyError,
)
from .model import Topology
from .topology import load as load_topology
from .topology import parse as parse_topology

__all__ = [
    "ConfgenError",
    "Diagnostic",
    "OutputError",
    "ProxyError",
    "SecretError",
    "Severity",
    "Topology",
    "TopologyError",
    "VerifyError",
    "load_topology",
    "parse_topology",
]
__version__ = "0.1.0"
