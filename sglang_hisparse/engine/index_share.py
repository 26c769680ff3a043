"""IndexShare: which layers run their indexer and which reuse an earlier one's top-k.

GLM-5.2-style DSA models share one indexer selection across consecutive
layers. A layer that runs its own indexer is an *anchor*; a *shared* layer
skips it and attends over the top-k of the nearest anchor before it (its
previous layer hands the top-k on: ``prev_topk_indices``). Since a shared
layer selects exactly the anchor's positions, its hot buffers go through the
same residency decisions as the anchor's, and what it must load from host is
the anchor's miss plan applied to its own layer's pools
(:mod:`sglang_hisparse.engine.prefetch`).

:func:`roles_from_config` reads the model configuration as SGLang 0.5.13's
``DeepseekV2AttentionMLA.__init__`` does (``models/deepseek_v2.py``; the
manifest pins that source by hash, and 0.5.15's ``dsa_layer_skips_topk``
it calls):

* ``index_topk_pattern`` (a string, one letter per layer): ``"S"`` shares,
  any other letter is an anchor;
* otherwise ``index_topk_freq`` (default 1) and ``index_skip_topk_offset``:
  layer ``l`` shares iff ``max(l - offset + 1, 0) % freq != 0`` when the
  offset is given (it must be > 0), else iff ``max(l - 1, 0) % freq != 0``
  (so ``freq=2`` gives F F S F S ...).

Releases differ at the edges (:class:`RoleRules`, picked per release in
``adapter/releases/``): 0.5.13 indexes the pattern by layer id (a pattern
shorter than the model fails there) and computes ``% None`` for an explicit
``index_topk_freq: null``; 0.5.15.post1 makes layers past the pattern's end
anchors and reads a null freq as 1; 0.5.17 reads ``cli_factor`` first: when
it is above 1, layer ``l`` shares iff ``l % cli_factor != 0`` and the other
fields are not read.

NextN (draft) layers always share in the model, but the draft runs without
HiSparse, so they are no concern here. :func:`prefetch_off_reason` decides whether
the prefetch runs at all: not for DeepSeek-V4 (each C4 layer has its own
indexer), not under pipeline parallelism (a stage's first layer may share an
anchor of another stage, and the pools hold only the stage's layers), not
with ``SGLANG_HISPARSE_INDEXSHARE_PREFETCH=0`` (A/B runs: every layer then
swaps in synchronously, as 0.5.13 does), and not for a model without a
shared layer. This module imports neither torch nor SGLang.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Optional

from sglang_hisparse.config import INDEXSHARE_PREFETCH_ENV


class IndexShareConfigError(ValueError):
    """A model configuration whose index sharing the model code cannot run."""


class Role(enum.Enum):
    ANCHOR = "F"  # runs its indexer; its swap-in resolves and records the miss plan
    SHARED = "S"  # reuses the previous anchor's top-k; its bytes follow the plan


@dataclass(frozen=True)
class LayerRoles:
    """The role of every layer (index = the layer id attention sees)."""

    roles: tuple[Role, ...]

    def __post_init__(self):
        if self.roles and self.roles[0] is Role.SHARED:
            raise IndexShareConfigError("layer 0 cannot share: no earlier layer ran its indexer")
        anchor_of, followers = [], {}
        last = 0
        for layer, role in enumerate(self.roles):
            if role is Role.ANCHOR:
                last = layer
                followers[layer] = []
            else:
                followers[last].append(layer)
            anchor_of.append(last)
        # Read per layer per decode step: plain tuples, no method calls.
        object.__setattr__(self, "anchor_of", tuple(anchor_of))
        object.__setattr__(self, "is_shared", tuple(r is Role.SHARED for r in self.roles))
        object.__setattr__(self, "followers",
                           {a: tuple(f) for a, f in followers.items() if f})

    @classmethod
    def from_pattern(cls, pattern: str) -> "LayerRoles":
        return cls(tuple(Role.SHARED if c == "S" else Role.ANCHOR for c in pattern))

    @property
    def pattern(self) -> str:
        return "".join(r.value for r in self.roles)

    @property
    def num_layers(self) -> int:
        return len(self.roles)

    @property
    def shares(self) -> bool:
        return any(self.is_shared)

    def __str__(self) -> str:
        shared = sum(self.is_shared)
        return (f"{self.num_layers - shared} anchor and {shared} shared layers "
                f"({self.pattern})")


@dataclass(frozen=True)
class RoleRules:
    """Where a release's model code reads the sharing fields differently."""

    short_pattern_anchors: bool  # layers past index_topk_pattern's end run their indexer
    null_freq_is_one: bool  # index_topk_freq: null reads as 1
    cli_factor: bool = False  # cli_factor > 1 decides alone (every cli_factor-th layer anchors)


# 0.5.13 and .post1 (DeepseekV2AttentionMLA.__init__ inline).
RULES_0_5_13 = RoleRules(short_pattern_anchors=False, null_freq_is_one=False)
# 0.5.15.post1 (configs/model_config.py dsa_layer_skips_topk).
RULES_0_5_15 = RoleRules(short_pattern_anchors=True, null_freq_is_one=True)
# 0.5.17 (DeepseekV2AttentionMLA.__init__ reads cli_factor before dsa_layer_skips_topk).
RULES_0_5_17 = RoleRules(short_pattern_anchors=True, null_freq_is_one=True, cli_factor=True)


def roles_from_config(config, num_layers: int, rules: RoleRules = RULES_0_5_13) -> LayerRoles:
    """The roles of layers ``0 .. num_layers - 1`` from the model's (text)
    config object, read the way the release's model code reads it (see the
    module docstring; ``rules``: the release's, ``adapter/releases``'s
    ``index_share_rules()``). A configuration the model code would fail on
    raises :class:`IndexShareConfigError` naming the field."""
    if rules.cli_factor:
        factor = getattr(config, "cli_factor", 1)
        # The model code compares it with 1 (None fails there) and takes layer ids modulo it.
        if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
            raise IndexShareConfigError(
                f"cli_factor: expected an integer >= 1, got {factor!r}")
        if factor > 1:
            return LayerRoles(tuple(Role.SHARED if layer % factor else Role.ANCHOR
                                    for layer in range(num_layers)))
    pattern = getattr(config, "index_topk_pattern", None)
    freq = getattr(config, "index_topk_freq", 1)
    if freq is None and rules.null_freq_is_one:
        freq = 1
    offset = getattr(config, "index_skip_topk_offset", None)
    if pattern is not None:
        short_ok = rules.short_pattern_anchors and isinstance(pattern, str)
        if not isinstance(pattern, str) or (len(pattern) < num_layers and not short_ok):
            raise IndexShareConfigError(
                f"index_topk_pattern: expected a string of at least {num_layers} letters "
                f"('F' runs the indexer, 'S' reuses the previous top-k), got {pattern!r}")
        skip = [layer < len(pattern) and pattern[layer] == "S" for layer in range(num_layers)]
    else:
        if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise IndexShareConfigError(
                f"index_topk_freq: expected an integer >= 1, got {freq!r}")
        if offset is not None:
            if not isinstance(offset, int) or isinstance(offset, bool) or offset <= 0:
                raise IndexShareConfigError(
                    f"index_skip_topk_offset: must be a positive integer (offset <= 0 makes "
                    f"layer 0 share with no earlier top-k), got {offset!r}")
            skip = [max(layer - offset + 1, 0) % freq != 0 for layer in range(num_layers)]
        else:
            skip = [max(layer - 1, 0) % freq != 0 for layer in range(num_layers)]
    if skip and skip[0]:
        raise IndexShareConfigError(
            "index_topk_pattern: layer 0 is 'S' but no earlier layer runs its indexer; "
            "the first letter must be 'F'")
    return LayerRoles(tuple(Role.SHARED if s else Role.ANCHOR for s in skip))


def prefetch_off_reason(roles: Optional[LayerRoles], *, is_deepseek_v4: bool, pp_size: int,
                        environ: Mapping[str, str]) -> Optional[str]:
    """None when the IndexShare prefetch runs for a model with these roles,
    else why not, in words (logged once by the coordinator)."""
    if is_deepseek_v4:
        return "DeepSeek-V4 layers each run their own indexer"
    if roles is None or not roles.shares:
        return "no layer shares an indexer"
    if environ.get(INDEXSHARE_PREFETCH_ENV) == "0":
        return f"{INDEXSHARE_PREFETCH_ENV}=0: shared layers swap in synchronously"
    if pp_size > 1:
        return "pipeline parallelism: a stage holds only its own layers"
    return None
