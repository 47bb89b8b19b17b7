"""A random-weight model of a real model's shape, saved as an HF directory in bf16 with a byte
tokenizer: what scripts/gpu_check.sh times the engine on where the real weights are not at hand.
Speed does not depend on the weights' values, only on the shapes.

    python -m tests.gpu.random_model DIR [--shape smollm2] [--layers N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tests.conftest import build_byte_tokenizer

SHAPES = {
    # SmolLM2-135M-Instruct, the embedded model (docs: DESIGN.md)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


def build(path: Path, shape: str, layers: int | None = None,
          dtype: torch.dtype = torch.bfloat16) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(SHAPES[shape])
    if layers is not None:
        config["num_hidden_layers"] = layers
    model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path)
    p.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quicker check)")
    args = p.parse_args()
    print(build(args.path, args.shape, args.layers))


if __name__ == "__main__":
    main()
