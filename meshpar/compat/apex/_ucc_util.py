"""``apex.transformer._ucc_util``: whether torch was built with the UCC backend."""

import torch.distributed as dist

HAS_UCC = hasattr(dist, "is_ucc_available") and dist.is_ucc_available()
