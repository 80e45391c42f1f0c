"""Model runners: one Hugging Face model, its KV cache and the tokens it holds, one class per mode
behind the `Runner` protocol, chosen by `make_runner`.

    protocol.py      Runner: what the loops and drafters call (forward_rows, rollback_row, ...)
    factory.py       make_runner(model, rows=, use_cache=, encoder_input_ids=, costs=)
    sequence.py      SequenceRunner: one sequence (forward, forward_tree, keep_path, rollback)
    shared_batch.py  SharedBatchRunner: the rows of a batch in one cache, one pass for all
    per_row.py       PerRowRunner: one SequenceRunner per row (models that cannot share passes)
    beam.py          BeamRunner: beam search's beams
    static.py        StaticRunner: rows over a fixed KV buffer (utils/lean/static_kv.py)
    passes.py        ModelPasses: every pass, its CPU shortcuts and its timing into the costs
    compat.py        every difference between transformers releases, every touch of a Cache
    model_info.py    what is read from a model: kind, sizes, devices, attention
"""

from utils.runners.beam import BeamRunner
from utils.runners.factory import make_runner
from utils.runners.per_row import PerRowRunner
from utils.runners.protocol import Blocks, Runner
from utils.runners.sequence import SequenceRunner
from utils.runners.shared_batch import SharedBatchRunner
from utils.runners.static import StaticRunner

__all__ = ["BeamRunner", "Blocks", "PerRowRunner", "Runner", "SequenceRunner", "SharedBatchRunner", "StaticRunner",
           "make_runner"]
