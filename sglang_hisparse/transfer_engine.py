"""The Mooncake transfer engine on this machine, for the doctor's PD section.

A PD deployment (``--disaggregation-mode prefill`` / ``decode``) moves the
KV with Mooncake: SGLang imports ``mooncake.engine.TransferEngine`` in every
scheduler and initializes it with ``P2PHANDSHAKE`` and the transport that
``MOONCAKE_PROTOCOL`` names (``rdma`` by default; ``tcp`` when the backend is
``mooncake_tcp``, which sets ``MC_FORCE_TCP=1``). Whether that works is
decided on each node by what is installed, so the doctor reports it: which
build of the engine is installed, whether it imports (with the loader's
error when not) and which transports it can use. Nothing of SGLang is
imported here, and no engine is started (that would open ports).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field

# The CUDA each Mooncake build links (its engine.so needs that libcudart and
# the driver's libcuda.so.1); the pins run torch 2.11.0+cu130.
BUILD_CUDA = {
    "mooncake-transfer-engine-cuda13": "13",
    "mooncake-transfer-engine": "12",
    "mooncake-transfer-engine-non-cuda": None,
}
# What our [pd] extra installs (setup.cfg).
PD_EXTRA_BUILD = "mooncake-transfer-engine-cuda13"
# The kernel lists RDMA (verbs) devices here; no device, no RDMA transport.
VERBS_DEVICES = "/sys/class/infiniband"
# System libraries engine.so links even for TCP, and where Debian has them.
SYSTEM_LIBRARIES = (
    "libibverbs.so.1 and libmlx5.so.1 (Debian/Ubuntu: apt-get install libibverbs1 "
    "ibverbs-providers)"
)


@dataclass
class EngineStatus:
    builds: list[tuple[str, str]]  # (distribution, version) of every installed build
    import_error: str | None  # None: mooncake.engine.TransferEngine imported
    # (transport, usable, how that was determined)
    transports: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def importable(self) -> bool:
        return self.import_error is None


def installed_builds() -> list[tuple[str, str]]:
    """The distributions that provide the ``mooncake`` package (every build
    installs the same files, so more than one is a broken install)."""
    names = importlib.metadata.packages_distributions().get("mooncake", [])
    return sorted({(n, importlib.metadata.version(n)) for n in names})


def verbs_devices(root: str = VERBS_DEVICES) -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def status(verbs_root: str = VERBS_DEVICES) -> EngineStatus:
    builds = installed_builds()
    if not builds:
        return EngineStatus(builds, "not installed")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError / OSError from the dynamic loader
        return EngineStatus(builds, f"{type(exc).__name__}: {exc}")
    devices = verbs_devices(verbs_root)
    transports = [
        ("tcp", True, "always (Mooncake's TCP transport needs no device)"),
        ("rdma", bool(devices),
         f"verbs devices {', '.join(devices)} (listed in {verbs_root})" if devices
         else f"no verbs device listed in {verbs_root}"),
    ]
    return EngineStatus(builds, None, transports)


def _torch_cuda() -> str | None:
    try:
        import torch

        return torch.version.cuda
    except Exception:
        return None


def status_lines(st: EngineStatus) -> list[str]:
    """The doctor's section: one line per fact, a hint where something is missing."""
    lines = ["\nPD transfer engine (Mooncake; --disaggregation-transfer-backend mooncake or mooncake_tcp):"]
    if not st.builds:
        lines.append(f"  not installed: pip install \"sglang-hisparse[pd]\" ({PD_EXTRA_BUILD})")
        return lines
    torch_cuda = _torch_cuda()
    for name, version in st.builds:
        cuda = BUILD_CUDA.get(name, "unknown")
        built = f"CUDA {cuda}" if cuda else "no CUDA"
        lines.append(f"  build     {name} {version} ({built}; torch is built for CUDA {torch_cuda})")
        if cuda and torch_cuda and cuda != torch_cuda.split(".")[0]:
            lines.append(f"            -> a CUDA {cuda} build beside a CUDA {torch_cuda} torch: "
                         f"install {PD_EXTRA_BUILD} instead")
    if len(st.builds) > 1:
        lines.append("            -> several builds own the same mooncake/ files: keep one")
    if st.import_error is not None:
        lines.append(f"  import    FAIL {st.import_error}")
        lines.append(f"            engine.so needs the system's {SYSTEM_LIBRARIES}; a CUDA build "
                     "also needs the NVIDIA driver's libcuda.so.1")
        return lines
    lines.append("  import    OK mooncake.engine.TransferEngine")
    for name, usable, how in st.transports:
        lines.append(f"  {name:<9} {'yes' if usable else 'no '} {how}")
    return lines
