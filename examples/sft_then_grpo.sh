#!/usr/bin/env bash
# SFT warm start, then GRPO, on the chat-format toy task (docs/sft.md), from the repository root.
#
# The tiny random model alone barely moves on this task in 20 GRPO steps (reward 0.002 ->
# 0.008); 20 SFT steps (~3 s) first put it where GRPO takes off (0.07 -> 0.65 in the same 20
# steps). tests/test_sft.py::test_grpo_after_sft_beats_grpo_alone runs the same comparison.
set -euo pipefail
OUT=${OUT:-outputs/sft_then_grpo}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false VLLM_CPU_KVCACHE_SPACE=1

# 1. One parquet file for both stages: `messages` for SFT, verl's RL columns for GRPO.
.venv/bin/streamrl data sft-toy --out "$OUT/toy.parquet" --size 256

# 2. SFT on the assistant turns only; checkpoints in $OUT/sft, the HF model in $OUT/sft/hf.
#    (learner.world_size=2 runs two FSDP2 ranks; trainer.resume=auto continues a killed run.)
.venv/bin/streamrl sft "data.train_files=[$OUT/toy.parquet]" model.path=tiny optim.lr=3e-3 \
    trainer.total_steps=20 trainer.output_dir="$OUT/sft"

# 3. GRPO from the SFT model, on the same prompts rendered by the same chat template.
.venv/bin/streamrl train model.path="$OUT/sft/hf" task.source=parquet \
    "task.train_files=[$OUT/toy.parquet]" task.train_batch_size=16 actor.ppo_mini_batch_size=16 \
    trainer.total_steps=20 trainer.output_dir="$OUT/grpo"

# For comparison, GRPO alone in the same number of steps:
#   .venv/bin/streamrl train model.path=tiny task.source=parquet "task.train_files=[$OUT/toy.parquet]" \
#       task.train_batch_size=16 actor.ppo_mini_batch_size=16 trainer.total_steps=20 \
#       trainer.output_dir="$OUT/grpo_alone"
