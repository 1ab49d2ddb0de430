"""Evaluation of a model: the mean per-token loss (and perplexity) over local data
(``evaluate``), and for prompt/response data the response loss plus ROUGE-L of greedy
generations (``rouge``). Used by the trainer's periodic eval and by ``lmforge eval`` /
``lmforge eval-sft``; nothing here imports the trainer.
"""
