"""Everything that touches SGLang, one module per SGLang subsystem.

This package is the only importer of ``sglang.srt`` (``tests/test_layout.py``
enforces it), and the manifest's hook implementations point into it, so a
new pin or a new SGLang seam is a change here:

* :mod:`.args` - server arguments (``--enable-hisparse``, ``--hisparse-config``);
* :mod:`.scheduler` - the scheduler's abort and batch selection;
* :mod:`.model_runner` - the coordinator SGLang builds, ``max_token_pool_size``;
* :mod:`.metrics` - the decode log line, pool stats, Prometheus;
* :mod:`.speculative` - the EAGLE v2 worker's seams of a verify step (spec
  reserve, verify slots, indexer positions, commit, the draft runner);
* :mod:`.native` - the native comparison mode's hook (SGLANG_HISPARSE_NATIVE=1);
* :mod:`.disaggregation_dsv4` - PD with a DeepSeek-V4 draft: the draft's SWA
  state in the transfer (with or without HiSparse);
* :mod:`.sglang_classes` - the SGLang base classes our pools derive from;
* :mod:`.hook_registry` - installing hooks through SGLang's ``HookRegistry``;
* :mod:`.releases` - what differs per pinned release (one module per release
  line, chosen for the installed one in one place).
"""
