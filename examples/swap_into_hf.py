"""Swap pyembed into a Hugging Face GPT-2 and check that nothing changes but speed.

Builds a GPT-2 from a config (the real vocabulary and width, V=50257, d=768; a single
transformer block so it runs on a CPU; nothing downloaded), makes a copy with
``pyembed.replace_embeddings``, trains both a few steps side by side (the losses agree),
then times the embedding layer (token + position lookup, forward + backward) three ways:
the model's own nn.Embedding pair, the swapped pair (drop-in FusedEmbedding modules),
and one fused ``EmbeddingLayer.from_modules(wte, wpe)`` over the same Parameters.

    python examples/swap_into_hf.py            # ~40 s on a 2-core CPU
    python examples/swap_into_hf.py --steps 2 --batch 2 --seq-len 64
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.utils.benchmark as benchmark
from transformers import GPT2Config, GPT2LMHeadModel

import pyembed


def time_fwd_bwd(fn, ids: torch.Tensor, params: list[torch.Tensor], label: str) -> benchmark.Measurement:
    """Median time of out = fn(ids); out.backward(g), gradients reset before each run."""
    grad = torch.randn(*ids.shape, params[0].shape[1], device=ids.device)

    def step():
        for p in params:
            p.grad = None
        fn(ids).backward(grad)

    return benchmark.Timer("step()", globals={"step": step}, label="GPT-2 input layer, forward + backward",
                           description=label, num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_positions=args.seq_len, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    swapped = pyembed.replace_embeddings(copy.deepcopy(model))
    wte = swapped.transformer.wte
    print(f"GPT-2 on {device}: {type(wte).__name__} {tuple(wte.weight.shape)}, "
          f"still tied to the LM head: {swapped.lm_head.weight is wte.weight}")

    # Train both a few steps on the same batches: the losses agree.
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (model, swapped)]
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=generator).to(device)
        losses = []
        for m, opt in zip((model, swapped), optimizers):
            loss = m(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"step {step}: loss nn.Embedding {losses[0]:.6f}   pyembed {losses[1]:.6f}")

    # The input layer alone, three ways, on the same Parameters' values.
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), device=device)
    positions = torch.arange(args.seq_len, device=device)
    eager_wte, eager_wpe = model.transformer.wte, model.transformer.wpe
    fused = pyembed.EmbeddingLayer.from_modules(swapped.transformer.wte, swapped.transformer.wpe)
    results = [
        time_fwd_bwd(lambda x: eager_wte(x) + eager_wpe(positions), ids, [eager_wte.weight, eager_wpe.weight],
                     "nn.Embedding (model as built)"),
        time_fwd_bwd(lambda x: swapped.transformer.wte(x) + swapped.transformer.wpe(positions), ids,
                     [swapped.transformer.wte.weight, swapped.transformer.wpe.weight],
                     "FusedEmbedding x2 (replace_embeddings)"),
        time_fwd_bwd(fused, ids, [fused.token_embedding.weight, fused.pos_embedding],
                     "EmbeddingLayer.from_modules (one fused op)"),
    ]
    benchmark.Compare(results).print()
    base = results[0].median
    for r in results[1:]:
        print(f"{r.description}: {base / r.median:.2f}x the speed of nn.Embedding")


if __name__ == "__main__":
    main()
