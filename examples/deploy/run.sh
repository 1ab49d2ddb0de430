#!/usr/bin/env bash
# The end-to-end deploy example (README.md), on the CPU: pretrain a tiny Llama on
# random-colour statements (the form), score it on a local multiple-choice task, fine-tune
# it on the true colours with the task scored after the last step (eval.harness_tasks),
# export one GGUF file, and run it in llama.cpp beside `lmforge generate --greedy`.
# Needs lm-eval and llama-cpp-python (make setup; bash scripts/setup_deploy.sh). Run from
# the repository root with lmforge installed. BASE_STEPS / SFT_STEPS shorten it (the test).
set -euo pipefail
THREADS=${THREADS:-1}
BASE_STEPS=${BASE_STEPS:-300}
SFT_STEPS=${SFT_STEPS:-200}
OUT=${OUT:-runs/deploy}
DATA=$OUT/data
PROMPT=$'What colour is the sky?\n'

python examples/deploy/make_data.py --out $DATA --seed 0
lmforge tokenizer train --input $DATA/corpus.txt --vocab-size 400 --output $OUT/tokenizer

# the base: the statements' form, with colours at random
lmforge train model.preset=tiny model.tokenizer=$OUT/tokenizer data.kind=text \
    data.path=$DATA/corpus.txt data.seq_len=32 data.micro_batch_size=32 \
    data.eval_fraction=0 train.max_steps=$BASE_STEPS optim.lr=3e-3 optim.warmup_steps=20 \
    train.log_every=50 train.sample_prompt="What colour is the sky?" \
    train.threads=$THREADS train.output_dir=$OUT/base train.overwrite=true

# before: the base model on the task (written to $OUT/base/harness/colours.json)
lmforge bench-eval --model $OUT/base/hf --tasks colours --include-path $DATA/tasks \
    --device cpu > /dev/null

# fine-tune on the true colours; the task is scored after the last step
# (5% of the conversations are held out: the held-out loss, and the sample's prompt)
lmforge train model.init_from=$OUT/base/hf data.kind=sft data.path=$DATA/chat.jsonl \
    data.template=plain data.seq_len=32 data.micro_batch_size=32 \
    train.max_steps=$SFT_STEPS optim.lr=1e-3 optim.warmup_steps=10 train.log_every=50 \
    train.threads=$THREADS train.output_dir=$OUT/sft train.overwrite=true \
    eval.harness_tasks=colours eval.harness_include_path=$DATA/tasks

# one GGUF file, and the same prompt in llama.cpp and in lmforge
lmforge export $OUT/sft $OUT/sft/model.gguf --format gguf --gguf-dtype f32
python examples/deploy/llama_cpp_generate.py $OUT/sft/model.gguf "$PROMPT" 8 \
    > $OUT/llama-cpp.txt
lmforge generate --model $OUT/sft/hf --prompt "$PROMPT" --greedy --max-new-tokens 8 \
    --device cpu > $OUT/lmforge.txt
echo "llama.cpp: $(cat $OUT/llama-cpp.txt)"
echo "lmforge:   $(cat $OUT/lmforge.txt)"

# before and after, side by side ($OUT/report/summary.md)
lmforge report $OUT/base $OUT/sft --output $OUT/report
