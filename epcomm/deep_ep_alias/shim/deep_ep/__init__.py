"""`import deep_ep` resolved to epcomm: this folder is on sys.path only where the user asked for it
(`python -m epcomm.deep_ep_alias install`, or the folder put on PYTHONPATH by hand)."""
from epcomm import Buffer, Config, EventOverlap, __version__, topk_idx_t

from . import utils

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "utils"]
