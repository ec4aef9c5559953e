import os
import sys

import torch

# Ranks are forked from this process: keep it single-threaded so no OpenMP pool crosses a fork.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
