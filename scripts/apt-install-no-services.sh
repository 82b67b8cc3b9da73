#!/bin/sh
# Install Debian packages that the tests use for their binaries (prometheus/promtool,
# redis-server, ...) without leaving a service of theirs enabled or running.
#
# What Debian's maintainer scripts do (prometheus 2.42 postinst, read with
# `cat /var/lib/dpkg/info/prometheus.postinst`): `update-rc.d NAME defaults` and
# `deb-systemd-helper enable NAME.service` enable it at boot (SysV links and the systemd
# symlink), then `invoke-rc.d` / `deb-systemd-invoke` start it. Both starters honour
# /usr/sbin/policy-rc.d: a temporary one answering 101 ("action forbidden") refuses the
# start; afterwards every unit the packages ship is disabled (systemctl also runs
# systemd-sysv-install for the SysV links, and works without a running systemd).
# An existing policy-rc.d (Docker images ship one) is left as it is.
#
# Usage (as root): sh scripts/apt-install-no-services.sh PACKAGE...
set -eu
[ "$#" -gt 0 ] || { echo "usage: $0 PACKAGE..." >&2; exit 2; }

policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
	printf '#!/bin/sh\n# temporary, from confgen scripts/apt-install-no-services.sh\nexit 101\n' > "$policy"
	chmod 755 "$policy"
	trap 'rm -f "$policy"' EXIT
	trap 'exit 130' INT TERM
fi

apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"

for pkg in "$@"; do
	# systemd units the package ships (not templates: foo@.service has no instance to disable)
	for unit in $(dpkg -L "$pkg" | sed -n 's#^/\(usr/\)\{0,1\}lib/systemd/system/\([^/@]*\.service\)$#\2#p'); do
		if command -v systemctl >/dev/null 2>&1; then
			systemctl disable "$unit" >/dev/null 2>&1 || true
			if [ -d /run/systemd/system ]; then systemctl stop "$unit" || true; fi
			if systemctl is-enabled --quiet "$unit" 2>/dev/null; then
				echo "$pkg: $unit is still enabled; disable it: systemctl disable --now $unit" >&2
				exit 1
			fi
		fi
		echo "==> $pkg: $unit installed, not enabled, not started"
	done
	# SysV init scripts (hosts without systemctl)
	for script in $(dpkg -L "$pkg" | sed -n 's#^/etc/init\.d/\([^/]*\)$#\1#p'); do
		if ! command -v systemctl >/dev/null 2>&1; then
			update-rc.d "$script" disable >/dev/null 2>&1 || true
		fi
	done
done
