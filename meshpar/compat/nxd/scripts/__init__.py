"""``neuronx_distributed.scripts``: the checkpoint converter NxD's training examples subclass
(:mod:`~meshpar.compat.nxd.scripts.checkpoint_converter`) and its NxDT YAML reader (:mod:`.yaml_converter`)."""
