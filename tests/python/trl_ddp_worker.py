"""One process of test_trl_ddp.py's data-parallel run:

    accelerate launch --cpu --num_processes 2 --mpirun_hostfile HOSTS \
        trl_ddp_worker.py MODEL_DIR OUT_JSON
    (or python -m torch.distributed.run --standalone --nproc_per_node 2 ...)

For each case, trl.GRPOTrainer and fusedgrpo.trl.FusedGRPOTrainer train the
same tiny model for 2 steps from the same seed (so they sample the same
completions), on CPU with DDP over gloo (accelerate's MULTI_CPU, which
mpirun's or torchrun's environment selects). Rank 0 writes {case: {arm: log_history}}.
"""
from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fusedgrpo.trl import FusedGRPOTrainer  # noqa: E402

# dapo: num_items_in_batch (TRL's global tokens / world size); grpo at the
# sequence level with gradient accumulation: per-sequence means, / steps.
CASES = {
    "dapo": dict(loss_type="dapo", beta=0.04),
    "grpo_sequence_ga2": dict(loss_type="grpo", importance_sampling_level="sequence",
                              beta=0.04, gradient_accumulation_steps=2),
}


def reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def train(cls, model_dir, out_dir, cfg):
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, report_to=[], use_cpu=True, logging_steps=1,
                      bf16=False, max_steps=2, seed=0, save_strategy="no",
                      disable_tqdm=True, **cfg)
    ds = Dataset.from_dict({"prompt": ["t1 t2 t3", "t4 t5", "t6 t7 t8", "t9"] * 4})
    trainer = cls(model=model_dir, reward_funcs=reward, args=args, train_dataset=ds)
    trainer.train()
    return trainer.accelerator, trainer.state.log_history


def main(model_dir, out_json):
    results = {}
    for name, cfg in CASES.items():
        for arm, cls in (("trl", GRPOTrainer), ("fusedgrpo", FusedGRPOTrainer)):
            acc, logs = train(cls, model_dir, os.path.join(os.path.dirname(out_json), arm), cfg)
            results.setdefault(name, {})[arm] = logs
    results["world_size"] = acc.num_processes
    if acc.is_main_process:
        with open(out_json, "w") as f:
            json.dump(results, f)
    # The gloo group torn down here, not by the interpreter's exit: left to
    # the exit, its threads are destroyed in no set order and a rank can
    # abort ("terminate called without an active exception") after the runs.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # Every result is written and every rank past the barrier: leave without
    # the interpreter's teardown, whose C++ destructors (threads of the
    # libraries the trainers load) still aborted a rank now and then after
    # the group was destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
