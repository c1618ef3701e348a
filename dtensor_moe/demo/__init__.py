"""A small MoE transformer trained under a parallel layout: ``python -m dtensor_moe.demo``.

Modules, in the order to read them (``docs/quickstart.md`` walks through them):

- ``model``: the single-device model (embeddings, attention + MoE blocks, RMSNorm, LM head);
- ``data``: synthetic data from a fixed random Markov chain, with its entropy rate;
- ``layout``: every parallelism decision, in one function (``apply_layout``);
- ``train``: the training step (fused AdamW, ``clip_grad_norm_``, expert-bias update);
- ``pipeline``: the pipeline stages and their schedule (``--pp``);
- ``config``, ``launch``, ``report``: flags and checks, processes, output.
"""
