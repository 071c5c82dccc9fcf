"""``neuronx_distributed.kernels``: the attention entry points NxD's training examples call (its Llama and DBRX
models import them at the top), on torch's fused attention instead of Neuron's NKI kernels."""
