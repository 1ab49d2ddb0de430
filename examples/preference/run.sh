#!/usr/bin/env bash
# The whole tiny preference example (README.md), start to finish, on the CPU: a tokenizer,
# SFT of a tiny Llama from scratch (the answer's form), then DPO with LoRA (the facts),
# and the held-out pairs scored before and after. Run from the repository root with
# lmforge installed (or PYTHONPATH=src). SFT_STEPS / DPO_STEPS shorten it (the test does).
set -euo pipefail
THREADS=${THREADS:-1}
SFT_STEPS=${SFT_STEPS:-400}
DPO_STEPS=${DPO_STEPS:-300}
OUT=${OUT:-runs/preference}
DATA=$OUT/data

python examples/preference/make_data.py --out $DATA --seed 0
lmforge tokenizer train --input $DATA/corpus.txt --vocab-size 400 --output $OUT/tokenizer

# SFT from scratch: the answer's form ("The X is Y."), colours at random
lmforge train model.preset=tiny model.tokenizer=$OUT/tokenizer data.kind=sft \
    data.path=$DATA/sft.jsonl data.template=plain data.seq_len=32 data.micro_batch_size=32 \
    train.max_steps=$SFT_STEPS optim.lr=3e-3 optim.warmup_steps=20 train.log_every=50 \
    train.sample_prompt=null train.threads=$THREADS train.output_dir=$OUT/sft \
    train.overwrite=true

# before: does the SFT model prefer the true colour? (reference-free, SimPO's reward)
lmforge eval --model $OUT/sft/hf --data $DATA/pairs-valid.jsonl --objective simpo \
    --template plain --seq-len 32 --output $OUT/eval-before.json

# DPO with LoRA: the reference is the SFT model itself (the adapters switched off)
lmforge train model.init_from=$OUT/sft/hf data.kind=preference data.path=$DATA/pairs.jsonl \
    data.eval_path=$DATA/pairs-valid.jsonl data.template=plain data.seq_len=32 \
    data.micro_batch_size=16 train.objective=dpo train.beta=0.5 lora.enabled=true \
    lora.targets=all-linear lora.rank=16 lora.alpha=32 optim.lr=1e-3 optim.warmup_steps=10 \
    train.max_steps=$DPO_STEPS train.eval_every=100 train.eval_batches=13 train.log_every=50 \
    train.sample_prompt=null train.threads=$THREADS train.output_dir=$OUT/dpo \
    train.overwrite=true

# after: the same score with the adapter, and DPO's held-out metrics against the SFT model
lmforge eval --model $OUT/sft/hf --adapter $OUT/dpo/adapter --data $DATA/pairs-valid.jsonl \
    --objective simpo --template plain --seq-len 32 --output $OUT/eval-after.json
lmforge eval --model $OUT/sft/hf --adapter $OUT/dpo/adapter --data $DATA/pairs-valid.jsonl \
    --objective dpo --beta 0.5 --template plain --seq-len 32 --output $OUT/eval-after-dpo.json
