"""``neuronx_distributed.parallel_layers.grads``: the global grad norm clip over tp, pp and dp."""

from meshpar.grad_clip import clip_grad_norm

__all__ = ["clip_grad_norm"]
