"""The model runners' public names, kept where they have always been imported from.

The runners live in `utils/runners/` (one class per mode behind the `Runner` protocol, chosen by
`make_runner`; the transformers-version differences in `utils/runners/compat.py`). `ModelRunner` is
the one-sequence runner, `SequenceRunner`; a batch comes from `make_runner(model, rows=...)`.
"""

from utils.runners import BeamRunner, PerRowRunner, Runner, SequenceRunner, SharedBatchRunner, make_runner
from utils.runners.model_info import context_length, input_device, is_encoder_decoder, model_devices, vocab_size
from utils.runners.passes import synchronize

ModelRunner = SequenceRunner  # the name the one-sequence runner had

__all__ = ["BeamRunner", "ModelRunner", "PerRowRunner", "Runner", "SequenceRunner", "SharedBatchRunner",
           "context_length", "input_device", "is_encoder_decoder", "make_runner", "model_devices",
           "synchronize", "vocab_size"]
