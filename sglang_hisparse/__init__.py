"""HiSparse for a pinned SGLang release, delivered as an SGLang plugin.

The package is imported by SGLang's plugin loader (entry point group
``sglang.srt.plugins``) in the launcher and in every scheduler process.
Importing it must stay cheap and must not import SGLang internals: the
loader in :mod:`sglang_hisparse.plugin` decides what to touch.
"""

__version__ = "0.1.0"

from sglang_hisparse.pins import supported_versions as _supported_versions

# SGLang releases this package carries a pin for (oldest first): the
# directories patches/sglang-<version>/ that hold a pin.json, which
# scripts/rebase.py --write creates (sglang_hisparse.pins).
SUPPORTED_SGLANG_VERSIONS = _supported_versions()
