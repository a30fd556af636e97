"""A Tinker-compatible training service: the official ``tinker`` SDK trains LoRA adapters on spinwheel.

``spinwheel tinker --model M`` serves Tinker's HTTP API (:mod:`~spinwheel.tinker.app`): training clients are LoRA
adapters with their own AdamW state over one frozen base (:mod:`~spinwheel.tinker.adapters`), ``forward_backward``
calls of different clients run in one batch (:mod:`~spinwheel.tinker.trainer`, :mod:`~spinwheel.tinker.service`),
sampling runs in the multi-LoRA engine over the same modules (:mod:`~spinwheel.tinker.sampler`), and state is saved
as PEFT adapters under the run directory, named by ``tinker://`` paths (:mod:`~spinwheel.tinker.checkpoints`).
"""
