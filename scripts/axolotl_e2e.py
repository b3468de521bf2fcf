"""The end-to-end run of ``scripts/test_axolotl.sh``: ``make DIR`` writes a tiny Llama (random weights, from its
config), a word-level tokenizer, a jsonl dataset and two Axolotl configs (``tiled.yml``: tiledmlp's plugin;
``untiled.yml``: the same without it) into DIR, nothing downloaded; ``compare DIR`` reads each run's logged losses
(its ``trainer_state.json``) and checks they agree within 1e-5 (relative), printing them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB, STEPS = 128, 4


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir = out / "model"
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t2",
                                        bos_token="t3")
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=2, bos_token_id=3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)

    rows = torch.Generator().manual_seed(1)
    with open(out / "data.jsonl", "w") as f:
        for _ in range(64):
            n = int(torch.randint(20, 60, (1,), generator=rows))
            ids = torch.randint(4, VOCAB, (n,), generator=rows).tolist()
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")

    common = f"""\
base_model: {model_dir}
datasets:
  - path: {out / 'data.jsonl'}
    ds_type: json
    type: completion
dataset_prepared_path: {out / 'prepared'}
val_set_size: 0
sequence_len: 64
micro_batch_size: 2
gradient_accumulation_steps: 2
max_steps: {STEPS}
optimizer: adamw_torch
lr_scheduler: constant
learning_rate: 0.001
seed: 42
bf16: false
fp16: false
tf32: false
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
logging_steps: 1
save_strategy: steps
save_steps: {STEPS}
save_safetensors: true
dataloader_num_workers: 0
"""
    (out / "untiled.yml").write_text(common + f"output_dir: {out / 'untiled'}\n")
    (out / "tiled.yml").write_text(common + f"""\
output_dir: {out / 'tiled'}
plugins:
  - tiledmlp.integrations.axolotl.TiledMLPPlugin
tiledmlp:
  seq_len: auto
  norms: true
  loss_scratch_mib: 0.01
""")


def losses(run: Path) -> list[float]:
    states = sorted(run.glob("checkpoint-*/trainer_state.json"))
    if not states:
        raise SystemExit(f"{run}: no checkpoint-*/trainer_state.json (did the run finish?)")
    history = json.loads(states[-1].read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def compare(out: Path) -> None:
    tiled, untiled = losses(out / "tiled"), losses(out / "untiled")
    print(f"losses tiled:   {tiled}\nlosses untiled: {untiled}")
    if len(tiled) != STEPS or len(untiled) != STEPS:
        raise SystemExit(f"expected {STEPS} logged losses per run")
    worst = max(abs(a - b) / abs(b) for a, b in zip(tiled, untiled))
    print(f"largest relative difference {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit("tiled and untiled losses differ by more than 1e-5 (relative)")


if __name__ == "__main__":
    {"make": make, "compare": compare}[sys.argv[1]](Path(sys.argv[2]).resolve())
