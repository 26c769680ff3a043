#!/usr/bin/env python3
"""Do SGLang's fused and unfused DSA top-k kernels pick the same positions?

A GPU diagnostic for the MTP logprob question (docs/gpu-runs/2026-12-02,
run 4): on verify rows our data plane needs raw token positions, so it runs
sgl_kernel's unfused ``fast_topk_v2``, where base 0.5.13 runs the fused
``fast_topk_transform_fused`` (top-k and page-table lookup in one kernel).
0.5.13 cannot put base on the unfused kernel under MTP
(``SGLANG_DSA_FUSE_TOPK=0`` asserts in the draft extend's
``transform_index_page_table_prefill_ref``, in base as well), so this script
compares the two kernels directly: given an identity page table the fused
kernel's output is a position list too, and the two selected *sets* must be
equal wherever the k-th and (k+1)-th scores differ. Rows whose scores tie at
the boundary may legitimately differ; the script counts both kinds.

    python3 scripts/topk_tiebreak.py [--json OUT.json]

Exit status 1 if any tie-free row differs (a real disagreement).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

TOPK = 2048


def boundary_tied(scores: torch.Tensor, length: int) -> bool:
    """Whether the TOPK-th and (TOPK+1)-th largest of scores[:length] are equal."""
    if length <= TOPK:
        return False
    top = torch.topk(scores[:length].float(), TOPK + 1).values
    return bool(top[TOPK - 1] == top[TOPK])


def compare(scores: torch.Tensor, lengths: torch.Tensor, rows_per_req: int) -> dict:
    from sgl_kernel import fast_topk_transform_fused, fast_topk_v2

    n_rows, width = scores.shape
    n_req = n_rows // rows_per_req
    unfused = fast_topk_v2(scores, lengths, TOPK)
    identity = torch.arange(width, dtype=torch.int32, device=scores.device).repeat(n_req, 1)
    cu_seqlens_q = torch.arange(0, n_rows + 1, rows_per_req, dtype=torch.int32, device=scores.device)
    fused = fast_topk_transform_fused(scores, lengths, identity, cu_seqlens_q, TOPK)
    torch.cuda.synchronize()
    out = {"rows": n_rows, "differ_tie_free": 0, "differ_tied": 0, "tied_rows": 0}
    for r in range(n_rows):
        length = int(lengths[r])
        a = {int(x) for x in unfused[r].tolist() if 0 <= x < length}
        b = {int(x) for x in fused[r].tolist() if 0 <= x < length}
        tied = boundary_tied(scores[r], length)
        out["tied_rows"] += tied
        if a != b:
            out["differ_tied" if tied else "differ_tie_free"] += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = 16384
    results = {}
    # rows_per_req 4: a 3/1/4 verify step's rows of one request (lengths S+1..S+4).
    for name, levels in (("continuous", None), ("256-level (many ties)", 256), ("16-level", 16)):
        for rows_per_req in (1, 4):
            n_req = 8
            scores = torch.randn(n_req * rows_per_req, width, device="cuda", generator=gen)
            if levels:
                scores = torch.round(scores * levels / 8) / (levels / 8)
            base_len = torch.randint(3000, width - rows_per_req, (n_req,), device="cuda", generator=gen)
            lengths = (base_len.repeat_interleave(rows_per_req)
                       + torch.arange(rows_per_req, device="cuda").repeat(n_req) + 1).to(torch.int32)
            res = compare(scores.contiguous(), lengths, rows_per_req)
            key = f"{name}, {rows_per_req} row(s)/request"
            results[key] = res
            print(f"{key:45s} rows {res['rows']:3d}  boundary-tied {res['tied_rows']:3d}  "
                  f"sets differ: tie-free {res['differ_tie_free']:3d}, tied {res['differ_tied']:3d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r["differ_tie_free"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
