"""A Pod Security Standards "restricted" check (Kubernetes v1.30 rules, baseline included),
written from https://kubernetes.io/docs/concepts/security/pod-security-standards/ .

`violations(pod_spec)` lists every rule a pod spec breaks, as "container: rule" strings.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def violations(pod: dict[str, Any]) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext", {})
    # baseline
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"pod: {key}")
    if psc.get("windowsOptions", {}).get("hostProcess"):
        out.append("pod: hostProcess")
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {vol['name']}: hostPath")
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: type {sorted(kinds)} not allowed")
    for sysctl in psc.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl.get('name')}")
    if psc.get("seLinuxOptions", {}).get("type") not in SELINUX_TYPES:
        out.append("pod: seLinuxOptions.type")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    if psc.get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("pod: seccomp Unconfined")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = psc.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost")
    for c in _containers(pod):
        name = c.get("name", "?")
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if sc.get("seLinuxOptions", {}).get("type") not in SELINUX_TYPES:
            out.append(f"{name}: seLinuxOptions.type")
        if sc.get("seLinuxOptions", {}).get("user") or sc.get("seLinuxOptions", {}).get("role"):
            out.append(f"{name}: seLinuxOptions user/role")
        if sc.get("appArmorProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{name}: appArmorProfile")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        nonroot = sc.get("runAsNonRoot")
        if nonroot is False or (nonroot is None and not pod_nonroot):
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", {}).get("type")
        if seccomp == "Unconfined" or (seccomp is None and not pod_seccomp):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities.drop must include ALL")
        extra = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"{name}: capabilities.add {sorted(extra)}")
    return out
