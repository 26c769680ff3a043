"""The HiSparse engine: request state, tables, budgets, streams, the
coordinator that drives the lifecycle, and the policies over it.

Nothing under this package imports SGLang (``tests/test_layout.py``
enforces it): what SGLang hands us arrives as plain objects through
:mod:`sglang_hisparse.adapter`.
"""
