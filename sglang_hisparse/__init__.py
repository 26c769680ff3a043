"""HiSparse for a pinned SGLang release, delivered as an SGLang plugin.

The package is imported by SGLang's plugin loader (entry point group
``sglang.srt.plugins``) in the launcher and in every scheduler process.
Importing it must stay cheap and must not import SGLang internals: the
loader in :mod:`sglang_hisparse.plugin` decides what to touch.
"""

__version__ = "0.1.0"

# SGLang releases this package carries patches for. A pin upgrade adds a
# version here together with a ``patches/sglang-<version>/`` directory and
# refreshed hashes in the manifest (see scripts/rebase.py).
SUPPORTED_SGLANG_VERSIONS = ("0.5.13",)
