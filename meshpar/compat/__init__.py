"""The import paths of apex.transformer, neuronx-distributed (NxD) and OSLO, as views of meshpar.

Code written for those libraries runs with its imports changed and nothing else:

=====================================================  ===========================================================
``from apex.transformer import X``                     ``from meshpar.compat.apex import X``
``from apex.transformer.pipeline_parallel[.utils]``    ``from meshpar.compat.apex.pipeline_parallel[.utils]``
``import neuronx_distributed`` (``parallel_state``,     ``from meshpar.compat import nxd`` (same submodules)
``parallel_layers[.pad|.loss_functions|.utils]``,
``pipeline.NxDPPModel``)
``import oslo`` (``oslo.initialize``)                   ``from meshpar.compat import oslo``
=====================================================  ===========================================================

Nothing here holds state or re-implements: every name is meshpar's own function or class (see each module).
"""
