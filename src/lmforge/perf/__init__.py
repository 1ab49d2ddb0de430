"""Performance: what a run will cost and what it did.

``flops`` counts training FLOPs per token and knows the devices' peaks (MFU); ``estimate``
(with ``estimate_setup``, ``weights``, ``activations``) models the peak memory per device
before launch, ``tracker`` measures it on a real step; ``records`` reads a run's
metrics.jsonl back and ``report`` plots and summarises runs.
"""
