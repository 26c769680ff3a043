#!/usr/bin/env python3
"""Write a model directory (config.json only) for a random-weight DeepSeek-V3.2.

Serve it with ``--load-format dummy --skip-tokenizer-init`` (send
``input_ids``); e2e_gpu.py always passes both, and the kit's testweights
plugin re-draws the dummy weights N(0, 0.02). No weights or tokenizer files
are needed.

Geometries (each a config.json under tests/data/):
  tiny  the GPU kit's 4-layer model (tests/data/tiny-dsv32, a copy of
        .gpu/tiny-dsv32): hidden 1024, 64 heads
  v32   DeepSeek-V3.2's attention geometry (tests/data/dsv32-geometry, 61
        layers): hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
        qk_rope 64 + qk_nope 128, v_head_dim 128, indexer 64 heads x 128,
        index_topk 2048; every layer a dense MLP of intermediate_size 2048
        (no MoE), the rest as the tiny config. ~15.4 B parameters at 61
        layers, 31 GB of bf16 weights; the KV cache is what the real model's
        is per layer.

--layers N changes the layer count; a geometry whose layers are all dense
stays all dense (first_k_dense_replace follows N).

--index-pattern gives the model IndexShare layers (``index_topk_pattern``,
read by 0.5.13's model code): a string of F (runs its indexer) and S (reuses
the previous layer's top-k), one letter per layer, starting with F, e.g.
FSSS or FSFS for the 4-layer kit model; or ``glm52``: GLM-5.2's share of
anchors (21 of 78 layers) spread evenly over the layers, layer 0 first.

    python scripts/model_config.py --geometry v32 --layers 61 --out /tmp/dsv32-61
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GEOMETRIES = {
    "tiny": DATA / "tiny-dsv32" / "config.json",
    "v32": DATA / "dsv32-geometry" / "config.json",
}


GLM52_ANCHORS, GLM52_LAYERS = 21, 78


def index_pattern(spec: str, layers: int) -> str:
    """The ``index_topk_pattern`` for ``--index-pattern SPEC`` on ``layers`` layers."""
    if spec == "glm52":
        anchors = max(1, round(layers * GLM52_ANCHORS / GLM52_LAYERS))
        at = {round(i * layers / anchors) for i in range(anchors)}
        return "".join("F" if layer in at else "S" for layer in range(layers))
    if not spec or set(spec) - {"F", "S"} or len(spec) != layers or spec[0] != "F":
        raise ValueError(f"--index-pattern must be 'glm52' or {layers} letters F/S starting "
                         f"with F (one per layer), got {spec!r}")
    return spec


def build_config(geometry: str, layers: int | None = None,
                 index_pattern_spec: str | None = None) -> dict:
    if geometry not in GEOMETRIES:
        raise ValueError(f"--geometry must be one of {', '.join(GEOMETRIES)}, got {geometry!r}")
    cfg = json.loads(GEOMETRIES[geometry].read_text())
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        all_dense = cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = layers
        if all_dense:
            cfg["first_k_dense_replace"] = layers
    if index_pattern_spec:
        cfg["index_topk_pattern"] = index_pattern(index_pattern_spec, cfg["num_hidden_layers"])
    return cfg


def estimate(cfg: dict) -> dict:
    """Parameter count (bf16 bytes) and KV-cache bytes per token, for sizing
    --mem-fraction-static and --max-total-tokens (dense layers only)."""
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    attn = (h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * n * qk
            + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
            + cfg["kv_lora_rank"] * n * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
            + n * cfg["v_head_dim"] * h)
    indexer = (cfg["q_lora_rank"] * cfg["index_n_heads"] * cfg["index_head_dim"]
               + h * cfg["index_head_dim"] + h * cfg["index_n_heads"])
    mlp = 3 * h * cfg["intermediate_size"]
    layers = cfg["num_hidden_layers"]
    params = layers * (attn + indexer + mlp) + 2 * cfg["vocab_size"] * h
    # bf16 latent + rope row per layer, plus the indexer's fp8 key and its scale.
    kv_per_token = layers * (2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
                             + cfg["index_head_dim"] + 4)
    return {"params": params, "weight_bytes": 2 * params, "kv_bytes_per_token": kv_per_token}


def write(cfg: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="v32")
    ap.add_argument("--layers", type=int, default=None,
                    help="number of layers (default: the geometry's own)")
    ap.add_argument("--index-pattern", default=None, metavar="FS...|glm52",
                    help="IndexShare layers: index_topk_pattern (F runs the indexer, S reuses "
                         "the previous top-k), or glm52 (21 anchors per 78 layers)")
    ap.add_argument("--out", required=True, help="directory to write config.json into")
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args.geometry, args.layers, args.index_pattern)
    except ValueError as exc:
        print(f"model_config: {exc}", file=sys.stderr)
        return 2
    path = write(cfg, Path(args.out))
    est = estimate(cfg)
    print(f"{path}: {args.geometry}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads; ~{est['params'] / 1e9:.2f} B params "
          f"({est['weight_bytes'] / 2**30:.1f} GiB bf16), KV {est['kv_bytes_per_token'] / 1024:.1f} "
          f"KiB/token" + (f"; index_topk_pattern {cfg['index_topk_pattern']}"
                          if cfg.get("index_topk_pattern") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
