#!/usr/bin/env bash
# The whole tiny GRPO example (README.md), start to finish, on the CPU: a tokenizer, SFT of
# a tiny Llama from scratch (the answer's form), then GRPO (the facts, from a reward that
# checks them), and the held-out accuracy before and after. Run from the
# repository root with lmforge installed (or PYTHONPATH=src). SFT_STEPS / GRPO_STEPS
# shorten it (the test does).
set -euo pipefail
THREADS=${THREADS:-1}
SFT_STEPS=${SFT_STEPS:-400}
GRPO_STEPS=${GRPO_STEPS:-200}
OUT=${OUT:-runs/rl}
DATA=$OUT/data

python examples/rl/make_data.py --out $DATA --seed 0
lmforge tokenizer train --input $DATA/corpus.txt --vocab-size 400 --output $OUT/tokenizer

# SFT from scratch: the answer's form ("The X is Y."), colours at random
lmforge train model.preset=tiny model.tokenizer=$OUT/tokenizer data.kind=sft \
    data.path=$DATA/sft.jsonl data.template=plain data.seq_len=32 data.micro_batch_size=32 \
    train.max_steps=$SFT_STEPS optim.lr=3e-3 optim.warmup_steps=20 train.log_every=50 \
    train.sample_prompt=null train.threads=$THREADS train.output_dir=$OUT/sft \
    train.overwrite=true

# before: one greedy answer per held-out prompt, scored by the reward
python examples/rl/score.py --model $OUT/sft/hf --data $DATA/prompts-valid.jsonl \
    --output $OUT/score-before.json

# GRPO (full weights): 8 answers to each of 16 prompts a step, scored by the user reward
# examples/rl/rewards.py:true_colour; held-out reward logged every 50 steps (eval_reward)
lmforge train model.init_from=$OUT/sft/hf data.kind=prompts data.path=$DATA/prompts.jsonl \
    data.eval_path=$DATA/prompts-valid.jsonl data.template=plain data.seq_len=40 \
    data.micro_batch_size=16 rl.rewards=examples/rl/rewards.py:true_colour \
    rl.num_generations=8 rl.max_completion_length=12 rl.temperature=1.0 \
    optim.lr=3e-4 optim.warmup_steps=5 train.max_steps=$GRPO_STEPS train.eval_every=50 \
    train.eval_batches=4 train.log_every=10 train.sample_prompt=null train.threads=$THREADS \
    train.output_dir=$OUT/grpo train.overwrite=true

# after: the same score on the trained model
python examples/rl/score.py --model $OUT/grpo/hf --data $DATA/prompts-valid.jsonl \
    --output $OUT/score-after.json
