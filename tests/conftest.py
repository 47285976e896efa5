"""Test configuration.

Tiny models run far faster on one thread (no thread hand-off per tiny matmul),
so the suite uses one; tests of real models raise it for their own duration.
"""

import torch

torch.set_num_threads(1)
