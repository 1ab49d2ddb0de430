#!/usr/bin/env bash
# The whole tiny LoRA example, start to finish (see README.md). Run from the repository
# root with lmforge installed (or PYTHONPATH=src). THREADS=1 is fastest on a busy 2-core
# machine; on an idle one THREADS=0 (torch's default) may be faster.
set -euo pipefail
THREADS=${THREADS:-1}
DATA=runs/dialogsum/data
VALID=$DATA/validation.jsonl

python examples/dialogsum/make_data.py --out $DATA --seed 0
lmforge train configs/tiny-dialogsum-base.yaml train.threads=$THREADS

# before: the base model
lmforge eval --model runs/dialogsum/base/hf --data $VALID --seq-len 128 \
    --output runs/dialogsum/eval-loss-before.json
lmforge lora eval --model runs/dialogsum/base/hf --data $VALID --max-new-tokens 32 \
    --output runs/dialogsum/eval-before.json

# LoRA: adapter in runs/dialogsum/lora/adapter, merged model in runs/dialogsum/lora/hf
lmforge train configs/tiny-dialogsum-lora.yaml train.threads=$THREADS
lmforge lora eval --model runs/dialogsum/base/hf --adapter runs/dialogsum/lora/adapter \
    --data $VALID --max-new-tokens 32 --output runs/dialogsum/eval-after.json
lmforge eval --model runs/dialogsum/lora/hf --data $VALID --seq-len 128 \
    --output runs/dialogsum/eval-loss-after.json

# QLoRA: the same fine-tune over an NF4-quantized base, scored through its merged export
lmforge train configs/tiny-dialogsum-lora.yaml train.threads=$THREADS lora.quantize=nf4 \
    train.output_dir=runs/dialogsum/qlora
lmforge lora eval --model runs/dialogsum/qlora/hf --data $VALID --max-new-tokens 32 \
    --output runs/dialogsum/eval-after-qlora.json
