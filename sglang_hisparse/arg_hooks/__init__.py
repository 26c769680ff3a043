"""Our handling of ``--enable-hisparse`` and ``--hisparse-config`` on SGLang 0.5.13.

SGLang 0.5.13 declares both flags; these modules replace what it does with
them (manifest entries, scope ALWAYS):

* :mod:`.validation` - ``validate_hisparse``, run by ``ServerArgs.check_server_args``
  before weights load; the rules themselves are pure, in :mod:`.rules`.
* :mod:`.backends` - ``apply_hisparse_dsa_backend_defaults``: DSA backends
  that can read the HiSparse pool, picked by KV dtype.
* :mod:`.sparse_config` - ``parse_hisparse_config``: SGLang's ``SparseConfig``
  from our parser (:mod:`sglang_hisparse.config`) for the pool/coordinator code.

Importing this package does not import SGLang; the hooks import it lazily.
"""
